"""One run's figures, from what each response said (drive.py's outcomes) and the mesh's counters.

- reuse: cached_tokens over prompt tokens, summed over the completed turns after each session's first
  ("later") and over all completed turns ("all"); `ideal_*` the same share of what the trace allows
  (workload.ideal_cached_tokens), and `reuse_over_ideal` the later turns' cached over ideal tokens;
- lost_share: later turns that got less than LOST_BELOW of their ideal: the session's prefix was evicted
  from both tiers (or the turn went to a worker without it); TTFT of lost and kept later turns apart;
- moved_share: later turns served by another worker than the session's previous turn;
- from_host_share: of all reused prompt tokens, those loaded back from the host tier (the workers'
  host-hit blocks): the prefix had been evicted from the device and survived below it.
"""

from __future__ import annotations

from bench.agents.drive import Driven, Outcome
from bench.common.report import percentile

LOST_BELOW = 0.9


def _share(part: float, whole: float) -> float:
    return part / whole if whole else float("nan")


def _p(outcomes: list[Outcome], q: float) -> float:
    return percentile([o.ttft_ms for o in outcomes], q) if outcomes else float("nan")


def moved_share(turns: list[Outcome]) -> float:
    last: dict[str, str] = {}
    moved = later = 0
    for o in sorted(turns, key=lambda o: (o.session, o.turn)):
        if o.session in last and o.turn > 0:
            later += 1
            moved += o.worker != last[o.session]
        last[o.session] = o.worker
    return _share(moved, later)


def figures(driven: Driven, counters: dict[str, float], block_size: int) -> dict[str, float]:
    turns = driven.turns()
    done = [o for o in turns if o.ok]
    later = [o for o in done if o.turn > 0]
    lost = [o for o in later if o.cached_tokens < LOST_BELOW * o.ideal_cached]
    kept = [o for o in later if o.cached_tokens >= LOST_BELOW * o.ideal_cached]
    background = driven.background()
    bg_done = [o for o in background if o.ok]
    cached_all = sum(o.cached_tokens for o in done) + sum(o.cached_tokens for o in bg_done)
    host_blocks = counters.get("kvmesh_worker_host_hits_total", float("nan"))
    return {
        "turns_done": len(done),
        "turns_failed": len(turns) - len(done) + driven.turns_not_sent,
        "later_turns_done": len(later),
        "reuse_later": _share(sum(o.cached_tokens for o in later), sum(o.prompt_tokens for o in later)),
        "ideal_later": _share(sum(o.ideal_cached for o in later), sum(o.prompt_tokens for o in later)),
        "reuse_over_ideal": _share(sum(o.cached_tokens for o in later), sum(o.ideal_cached for o in later)),
        "reuse_all": _share(sum(o.cached_tokens for o in done), sum(o.prompt_tokens for o in done)),
        "ideal_all": _share(sum(o.ideal_cached for o in done), sum(o.prompt_tokens for o in done)),
        "ttft_later_p50_ms": _p(later, 50),
        "ttft_later_p99_ms": _p(later, 99),
        "ttft_first_p50_ms": _p([o for o in done if o.turn == 0], 50),
        "lost_share": _share(len(lost), len(later)),
        "ttft_lost_p50_ms": _p(lost, 50),
        "ttft_kept_p50_ms": _p(kept, 50),
        "ttft_kept_p99_ms": _p(kept, 99),
        "moved_share": moved_share(done),
        "from_host_share": _share(host_blocks * block_size, cached_all),
        "background_done": len(bg_done),
        "background_failed": len(background) - len(bg_done),
        "background_ttft_p50_ms": _p(bg_done, 50),
        "background_ttft_p99_ms": _p(bg_done, 99),
    }


def later_ttfts(driven: Driven) -> list[float]:
    """TTFT (ms) of every completed turn after a session's first: the plot's CDF."""
    return sorted(o.ttft_ms for o in driven.turns() if o.ok and o.turn > 0)
