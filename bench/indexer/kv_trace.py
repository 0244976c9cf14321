"""A synthetic router trace: prefix-sharing conversations on many workers, in Dynamo's event JSON.

Conversations open with one of a few hundred shared system prompts and grow turn by turn up to
4k tokens; each lives on one worker, which stores its new blocks under the previous block and
evicts its oldest conversations (tail blocks first) when over capacity. Queries continue
existing conversations or start new ones on a known system prompt. Deterministic for a seed.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from services.kv_protocol.hashing import chain_from, local_block_hashes

VOCAB = 32000


@dataclass(frozen=True)
class TraceSpec:
    workers: int = 16
    block_size: int = 16
    target_blocks: int = 1_100_000
    system_prompts: int = 256
    system_blocks: int = 32
    max_blocks: int = 256  # 4096 tokens at block size 16
    worker_capacity: int = 60_000
    queries: int = 2000
    seed: int = 0


def block_tokens(key: int, n_blocks: int, block_size: int) -> np.ndarray:
    return np.random.default_rng(key).integers(0, VOCAB, size=n_blocks * block_size, dtype=np.uint32)


@dataclass
class _Conversation:
    system: int
    own_key: int
    blocks: int  # own blocks stored so far (after the system prompt)
    worker: int


def write_trace(out_dir: Path, spec: TraceSpec = TraceSpec()) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    events_path, queries_path = out_dir / "events.jsonl", out_dir / "queries.jsonl"
    rng = random.Random(spec.seed)
    bs = spec.block_size
    system_locals = [local_block_hashes(block_tokens(10_000 + s, spec.system_blocks, bs).tolist(), bs)
                     for s in range(spec.system_prompts)]
    system_chain = [chain_from(locals_) for locals_ in system_locals]
    own_max = spec.max_blocks - spec.system_blocks
    held: list[dict[int, None]] = [{} for _ in range(spec.workers)]  # block hash -> None, in store order
    has_system: list[set[int]] = [set() for _ in range(spec.workers)]
    conversations: list[_Conversation] = []
    own_cache: dict[int, tuple[list[int], list[int]]] = {}
    event_ids = [0] * spec.workers
    stored = 0

    def own_blocks(conv: _Conversation) -> tuple[list[int], list[int]]:
        cached = own_cache.get(conv.own_key)
        if cached is None:
            locals_ = local_block_hashes(block_tokens(conv.own_key, own_max, bs).tolist(), bs)
            cached = own_cache[conv.own_key] = (chain_from(locals_, system_chain[conv.system][-1]), locals_)
            if len(own_cache) > 4096:
                own_cache.pop(next(iter(own_cache)))
        return cached

    with events_path.open("w") as ev:
        def emit(worker: int, data: object) -> None:
            event_ids[worker] += 1
            ev.write(json.dumps({"worker_id": worker, "event": {"event_id": event_ids[worker], "data": data}}))
            ev.write("\n")

        def store(worker: int, parent: int | None, hashes: list[int], locals_: list[int]) -> None:
            nonlocal stored
            emit(worker, {"stored": {"parent_hash": parent, "blocks": [
                {"block_hash": b, "tokens_hash": t} for b, t in zip(hashes, locals_)]}})
            for b in hashes:
                held[worker][b] = None
            stored += len(hashes)

        def evict(worker: int) -> None:
            over = len(held[worker]) - spec.worker_capacity
            if over <= 0:
                return
            victims = list(held[worker])[:over]
            for b in victims:
                del held[worker][b]
            emit(worker, {"removed": {"block_hashes": victims[::-1]}})
            has_system[worker] = {s for s in has_system[worker] if system_chain[s][0] in held[worker]}

        while stored < spec.target_blocks:
            if not conversations or rng.random() < 0.3:
                conv = _Conversation(rng.randrange(spec.system_prompts), rng.getrandbits(48), 0, rng.randrange(spec.workers))
                conversations.append(conv)
                if len(conversations) > 2000:
                    conversations.pop(0)
            else:
                conv = rng.choice(conversations)
            w = conv.worker
            if conv.system not in has_system[w] or system_chain[conv.system][-1] not in held[w]:
                store(w, None, system_chain[conv.system], system_locals[conv.system])
                has_system[w].add(conv.system)
            turn = rng.randint(4, 24)
            start, end = conv.blocks, min(own_max, conv.blocks + turn)
            if start < end:
                chain, locals_ = own_blocks(conv)
                parent = chain[start - 1] if start else system_chain[conv.system][-1]
                if start and chain[start - 1] not in held[w]:
                    store(w, system_chain[conv.system][-1], chain[:end], locals_[:end])
                else:
                    store(w, parent, chain[start:end], locals_[start:end])
                conv.blocks = end
            evict(w)

    with queries_path.open("w") as q:
        for i in range(spec.queries):
            if rng.random() < 0.7 and conversations:
                conv = rng.choice(conversations)
                own = block_tokens(conv.own_key, own_max, bs)
            else:
                conv = _Conversation(rng.randrange(spec.system_prompts), rng.getrandbits(48), 0, 0)
                own = block_tokens(conv.own_key, own_max, bs)
            tokens = np.concatenate([block_tokens(10_000 + conv.system, spec.system_blocks, bs), own])
            q.write(json.dumps({"query_id": i, "token_ids": tokens[: spec.max_blocks * bs].tolist()}))
            q.write("\n")
    return events_path, queries_path
