"""Loader for the Mooncake conversation trace slice in bench/traces/ (see bench/traces/README.md).

Rule: the trace gives, per request, ids of 512-token blocks (equal ids mean an equal prefix), not text. Each id
becomes the same 512 pseudo-random token ids every time (numpy default_rng(seed=id), integers in [10, 1000) as
uint32), and a prompt is its blocks' tokens concatenated and cut to input_length, so requests that share leading
block ids share exactly that token prefix. Ids stay below 1000 (the demo tokenizer holds about 1.1k) and at or above
10 (clear of special tokens).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, islice
from operator import itemgetter
from pathlib import Path

import numpy as np

DEFAULT_PATH = Path(__file__).resolve().parents[1] / "traces" / "mooncake_conversation_1500.jsonl"
TRACE_BLOCK_TOKENS = 512
TOKEN_LOW = 10
TOKEN_HIGH = 1000  # exclusive

# One shared int object per token value: prompts are tuples of references into this, not millions of new ints.
_TOKENS = tuple(range(TOKEN_HIGH))


@dataclass(frozen=True)
class TraceRequest:
    timestamp_s: float  # arrival, seconds since the start of the trace
    token_ids: tuple[int, ...]
    output_tokens: int


def block_tokens(hash_id: int) -> tuple[int, ...]:
    """The 512 token ids that stand for one trace block id (always the same for the same id)."""
    values = np.random.default_rng(seed=hash_id).integers(TOKEN_LOW, TOKEN_HIGH, size=TRACE_BLOCK_TOKENS, dtype=np.uint32)
    return itemgetter(*values.tolist())(_TOKENS)


def load(path: str | Path = DEFAULT_PATH, limit: int | None = None,
         max_input_tokens: int | None = None) -> list[TraceRequest]:
    """The trace's requests in file (arrival) order, at most `limit` of them, each prompt cut to
    `max_input_tokens` when given (the cut keeps the prefix, so sharing between prompts is preserved)."""
    blocks: dict[int, tuple[int, ...]] = {}
    requests: list[TraceRequest] = []
    with open(path) as f:
        for line in f:
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            row = json.loads(line)
            length = row["input_length"] if max_input_tokens is None else min(row["input_length"], max_input_tokens)
            ids = row["hash_ids"][: -(-length // TRACE_BLOCK_TOKENS)]
            for h in ids:
                if h not in blocks:
                    blocks[h] = block_tokens(h)
            tokens = tuple(islice(chain.from_iterable(blocks[h] for h in ids), length))
            requests.append(TraceRequest(row["timestamp"] / 1000.0, tokens, int(row["output_length"])))
    return requests


def ideal_reuse(requests: Sequence[TraceRequest], block_size: int) -> float:
    """Share of all prompt tokens that one infinite prefix cache with `block_size`-token blocks would serve.

    Requests are taken in order; a request reuses its leading full blocks already seen in any earlier request,
    each block identified by a chained hash (previous block's hash, block tokens), so an equal block after a
    different prefix does not count; then all its full blocks are added to the cache.
    """
    seen: set[int] = set()
    reused = total = 0
    for request in requests:
        tokens = request.token_ids
        total += len(tokens)
        chain_hashes: list[int] = []
        parent = 0
        for start in range(0, len(tokens) - block_size + 1, block_size):
            parent = hash((parent, tokens[start:start + block_size]))
            chain_hashes.append(parent)
        hits = 0
        for h in chain_hashes:
            if h not in seen:
                break
            hits += 1
        reused += hits * block_size
        seen.update(chain_hashes)
    return reused / total if total else 0.0
