"""Fitting a cost model to measured points: least squares with every coefficient >= 0.

Prefill: seconds = base + n * per_token + n * n / 1000 * quadratic, over (n, seconds).
Decode: step = base + batch * per_seq + batch * context * per_context_token, over
(batch, context per sequence, step seconds). A coefficient the fit would make negative (noise on
a term too small to see) is set to 0, the most negative first, and the rest fitted again.
Errors are relative, so a short prompt's 10% weighs as much as a long one's. A sweep at one
context cannot tell the per-sequence cost from the per-context one: the context term is then
left at 0.

LoRA adapter loads: seconds = base + size / 1e9 * per_gb, over (size in bytes, seconds). Loads of
adapters of one size cannot tell the two apart: the per-GB rate then keeps the default and the
base takes the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.profiles.cost_model import ADAPTER_LOAD_S_PER_GB, CostModel, ProfileError

# The fewest points that can tell each term apart (three prefill terms, three decode terms).
MIN_PREFILL_POINTS, MIN_DECODE_POINTS = 3, 3


def fit_cost_model(prefill: Sequence[tuple[int, float]], decode: Sequence[tuple[int, int, float]]) -> CostModel:
    if len({n for n, _ in prefill}) < MIN_PREFILL_POINTS:
        raise ProfileError(f"fit: need prefill points at {MIN_PREFILL_POINTS} or more prompt lengths")
    if len({(b, c) for b, c, _ in decode}) < MIN_DECODE_POINTS:
        raise ProfileError(f"fit: need decode points at {MIN_DECODE_POINTS} or more (batch, context) pairs")
    pb, pt, pq = _nonnegative_fit([[1.0, n, n * n / 1000.0] for n, _ in prefill], [s for _, s in prefill])
    if len({c for _, c, _ in decode}) > 1:
        db, ds, dc = _nonnegative_fit([[1.0, b, b * c] for b, c, _ in decode], [s for _, _, s in decode])
    else:
        (db, ds), dc = _nonnegative_fit([[1.0, b] for b, _, _ in decode], [s for _, _, s in decode]), 0.0
    if pt <= 0 or db <= 0:
        raise ProfileError("fit: the points show no cost per prompt token or no decode step time; "
                           "were the prompts served from cache?")
    return CostModel(pb, pt, pq, db, ds, dc)


def fit_adapter_load(loads: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(adapter_load_base_s, adapter_load_s_per_gb) from measured (size_bytes, seconds) loads."""
    if not loads:
        raise ProfileError("fit: no adapter load was measured")
    if len({size for size, _ in loads}) > 1:
        base, per_gb = _nonnegative_fit([[1.0, size / 1e9] for size, _ in loads], [t for _, t in loads])
        return base, per_gb
    size = loads[0][0]
    median = float(np.median([t for _, t in loads]))
    return max(0.0, median - size / 1e9 * ADAPTER_LOAD_S_PER_GB), ADAPTER_LOAD_S_PER_GB


def fit_error(cost: CostModel, prefill: Sequence[tuple[int, float]],
              decode: Sequence[tuple[int, int, float]]) -> dict[str, float]:
    """Median relative error of the model on the points, per kind."""
    def median_error(pairs: list[tuple[float, float]]) -> float:
        return float(np.median([abs(p - s) / s for p, s in pairs if s > 0])) if pairs else float("nan")

    return {"prefill": median_error([(cost.prefill_s(n), s) for n, s in prefill]),
            "decode": median_error([(cost.decode_step_s(b, b * c), s) for b, c, s in decode])}


def _nonnegative_fit(rows: list[list[float]], seconds: list[float]) -> list[float]:
    a = np.array(rows, dtype=float)
    y = np.array(seconds, dtype=float)
    weights = 1.0 / np.maximum(y, 1e-9)  # relative error
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while active:
        solved, *_ = np.linalg.lstsq(a[:, active] * weights[:, None], y * weights, rcond=None)
        if (solved >= 0).all():
            coef[:] = 0
            coef[active] = solved
            break
        # Drop the most negative term only: another may turn positive once it is gone.
        active.pop(int(np.argmin(solved)))
    return [float(c) for c in coef]
