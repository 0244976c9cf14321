"""The agent trace: sessions whose every turn resends the whole history, tool gaps between turns, and
unrelated background prompts that fill the workers' caches meanwhile.

A session's turn appends new tokens (a tool's output and the user's text, APPEND tokens drawn uniformly) to
its history, and the turn's prompt is the whole history so far: turn k's prompt = turn k-1's prompt + turn
k's new tokens. Prompts are token ids sent to /v1/completions, so two prompts share exactly the prefix the
trace says. The model's answer is not appended: the API returns text, and text does not turn back into the
same token ids, so an appended answer would break the prefix at the answer; the new tokens stand in for it.
Between a turn's answer and the next turn a tool runs for a gap drawn log-uniformly in [min_gap_s,
max_gap_s]; sessions start at uniformly drawn times within `start_spread_s`.

Background prompts belong to no session: each its own random tokens (nothing to reuse), arriving open-loop
(Poisson) at `background_rate_per_s` for the whole run. They are what evicts an idle session's history.

A seed fixes everything (every session's tokens, gaps, outputs and start, the background's prompts and
arrivals), so each mode of one seed is sent the very same trace (paired runs).

`ideal_cached_tokens` is what the trace allows a prefix cache to reuse: for each turn, the longest prefix it
shares with what its session sent before (the previous turn's prompt), in whole KV blocks.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

TOKEN_LOW, TOKEN_HIGH = 10, 1000  # token ids drawn in [low, high), as the other benchmarks do (demo vocab)


@dataclass(frozen=True)
class AgentWorkload:
    sessions: int = 64
    min_turns: int = 6
    max_turns: int = 12
    min_append: int = 500  # new tokens per turn (tool output + user text)
    max_append: int = 2000
    min_output: int = 16  # the answer's tokens (a tool call)
    max_output: int = 96
    min_gap_s: float = 2.0  # the tool's time between an answer and the next turn
    max_gap_s: float = 30.0
    start_spread_s: float = 20.0
    background_rate_per_s: float = 4.0
    min_background_prompt: int = 2048
    max_background_prompt: int = 6144
    background_output: int = 8
    background_span_s: float = 240.0  # arrivals drawn this far; the driver stops them when the sessions end

    def __post_init__(self) -> None:
        pairs = (("turns", self.min_turns, self.max_turns), ("append", self.min_append, self.max_append),
                 ("output", self.min_output, self.max_output), ("gap_s", self.min_gap_s, self.max_gap_s),
                 ("background_prompt", self.min_background_prompt, self.max_background_prompt))
        for name, low, high in pairs:
            if not 0 < low <= high:
                raise ValueError(f"{name}: need 0 < min <= max, got {low}, {high}")
        if self.sessions < 1 or self.start_spread_s < 0 or self.background_output < 1:
            raise ValueError("sessions and background_output must be >= 1, start_spread_s >= 0")
        if self.background_rate_per_s < 0 or self.background_span_s <= 0:
            raise ValueError("background_rate_per_s must be >= 0 and background_span_s > 0")

    def max_prompt_tokens(self) -> int:
        return self.max_turns * self.max_append


@dataclass(frozen=True, slots=True)
class Turn:
    prompt: list[int]  # the whole history so far
    output_tokens: int
    gap_after_s: float  # the tool's time before the next turn (0 after the last)
    shared_prefix: int  # tokens this prompt shares with the session's previous prompt


@dataclass(frozen=True, slots=True)
class Session:
    id: str
    start_s: float
    turns: tuple[Turn, ...]

    def planned_end_s(self) -> float:
        """When its last turn is sent if every answer came at once."""
        return self.start_s + sum(t.gap_after_s for t in self.turns)


@dataclass(frozen=True, slots=True)
class BackgroundRequest:
    at_s: float  # since the run's start
    prompt: list[int]


@dataclass(frozen=True)
class Trace:
    workload: AgentWorkload
    seed: int
    sessions: tuple[Session, ...]
    background: tuple[BackgroundRequest, ...]

    def turns(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def planned_span_s(self) -> float:
        return max(s.planned_end_s() for s in self.sessions)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n)]


def log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def _session(w: AgentWorkload, rng: random.Random, index: int, seed: int) -> Session:
    history: list[int] = []
    turns = []
    count = rng.randint(w.min_turns, w.max_turns)
    for k in range(count):
        shared = len(history)
        history = history + _tokens(rng, rng.randint(w.min_append, w.max_append))
        gap = log_uniform(rng, w.min_gap_s, w.max_gap_s) if k < count - 1 else 0.0
        turns.append(Turn(history, rng.randint(w.min_output, w.max_output), gap, shared))
    return Session(f"agent-{seed}-{index:03d}", rng.uniform(0.0, w.start_spread_s), tuple(turns))


def trace(w: AgentWorkload, seed: int) -> Trace:
    """The sessions (each from its own generator, so the background's draws do not shift them) and the
    background, all from `seed`."""
    sessions = tuple(_session(w, random.Random(f"agents-{seed}-{i}"), i, seed) for i in range(w.sessions))
    rng = random.Random(f"agents-{seed}-background")
    background = []
    at = 0.0
    while w.background_rate_per_s > 0:
        at += rng.expovariate(w.background_rate_per_s)
        if at > w.background_span_s:
            break
        background.append(BackgroundRequest(at, _tokens(rng, rng.randint(w.min_background_prompt,
                                                                          w.max_background_prompt))))
    return Trace(w, seed, sessions, tuple(background))


def ideal_cached_tokens(turn: Turn, block_size: int) -> int:
    """The most of the turn's prompt a prefix cache of `block_size`-token blocks could serve: the prefix
    it shares with its session's previous prompt, in whole blocks."""
    return turn.shared_prefix // block_size * block_size
