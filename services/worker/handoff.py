"""A decode worker's requests handed over with their KV when it drains (`--drain-mode move`).

The drain, after the worker has left etcd and peers had the propagation delay to notice, asks
the engine to hand over everything it runs (`Engine.move_out`): each call's last reply carries
its handoff (where the KV of its tokens so far is held) and the call ends with
OUTCOME_PEER_DRAINING; the processor re-routes the request at once with the handoff, and the
next worker pulls the KV instead of recomputing it. The drain then waits for those pulls (the
engine must not stop under them) and repeats for any call that arrived meanwhile, until nothing
is left or the drain timeout passes; what is still running then is ended by the server's stop
and moved by recomputing, as without moves.

An engine that cannot move (`Engine.can_move`: one started without NIXL) drains as before: its
requests finish, within the drain timeout. How each engine hands a request over:
engines/mocker/moves.py, engines/vllm_moves.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection

from prometheus_client import CollectorRegistry, Counter

from gen.kvmesh.v1 import common_pb2, worker_pb2
from services.engines.base import Engine, EngineOutput
from services.mesh.session_kind import CallError
from services.worker.kv_pull import kv_pull_to_proto

log = logging.getLogger(__name__)

# How often a drain looks again for calls left and pulls outstanding.
DRAIN_POLL_S = 0.01


def handoff_reply(out: EngineOutput) -> worker_pb2.WorkerGenerateResponse:
    """A handed-over request's last reply: where its KV is held (no params: nowhere)."""
    msg = worker_pb2.WorkerGenerateResponse(cached_tokens=out.cached_tokens)
    if out.kv_pull is not None:
        msg.handoff.CopyFrom(kv_pull_to_proto(out.kv_pull))
    else:
        msg.handoff.SetInParent()
    return msg


def moved_away() -> CallError:
    """How a handed-over call ends, after its handoff reply."""
    return CallError(common_pb2.OUTCOME_PEER_DRAINING, "the worker is draining: the request was handed over "
                                                       "to be continued on another worker")


class MoveMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.handed_over = Counter("kvmesh_decode_handed_over", "requests this worker handed over at a drain",
                                   registry=registry)
        self.moved_in = Counter("kvmesh_decode_moved_in", "requests moved here from a draining worker, by "
                                "whether their KV was pulled or recomputed", ["kv"], registry=registry)


async def hand_over(engine: Engine, request_ids: frozenset[str], metrics: MoveMetrics) -> int:
    """Hands the requests of `request_ids` over (a role switch's decode calls); how many."""
    handed = await engine.move_out(request_ids)
    metrics.handed_over.inc(handed)
    return handed


async def move_away(engine: Engine, worker_id: str, timeout_s: float, metrics: MoveMetrics,
                    decoding: Callable[[], Collection[str]]) -> None:
    """The drain's move step (above): hands over the decode calls in flight (`decoding`: their
    request ids; a switchable worker's engine may be prefilling for others too) until none is
    left and every handed over KV is pulled, or `timeout_s` has passed."""
    started = time.monotonic()
    deadline = started + timeout_s
    moved = 0
    while True:
        try:
            handed = await asyncio.wait_for(hand_over(engine, frozenset(decoding()), metrics),
                                            max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            break
        moved += handed
        if (not handed and not engine.moves_unpulled()) or time.monotonic() >= deadline:
            break
        await asyncio.sleep(DRAIN_POLL_S)
    left = engine.moves_unpulled()
    log.info("drain of %s: %d requests handed over in %.2fs%s", worker_id, moved, time.monotonic() - started,
             f"; {left} not pulled by the deadline (freed as they expire)" if left else "")
