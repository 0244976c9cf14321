"""The decode worker's Generate: decide where the prefill runs, then generate.

A request whose remote prefill succeeded is generated from the pulled KV; if that fails before
the first token (the KV cannot be pulled, the engine rejects it), the request is generated from
scratch locally instead — counted as a fallback — so no request is lost to the prefill pool.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import grpc

from gen.kvmesh.v1 import worker_pb2
from services.decode_worker.remote_prefill import DisaggMetrics, RemotePrefill, RemotePrefiller
from services.engines.base import Engine
from services.mesh.tasks import cancel_and_wait
from services.worker.kv_event_log import KvEventLog
from services.worker.servicer import LOCAL_PREFILL, WorkerServicer, remote_prefill, request_from_proto

log = logging.getLogger(__name__)


class DecodeServicer(WorkerServicer):
    def __init__(self, engine: Engine, worker_id: str, events: KvEventLog, prefiller: RemotePrefiller | None,
                 metrics: DisaggMetrics) -> None:
        super().__init__(engine, worker_id, events)
        self.prefiller = prefiller
        self.metrics = metrics
        # Releases of KV we abandoned, sent after our own request was cancelled: owned here.
        self._releases: set[asyncio.Task[None]] = set()

    async def stop(self) -> None:
        await cancel_and_wait(*self._releases)

    def _release_later(self, rid: str, remote: RemotePrefill) -> None:
        assert self.prefiller is not None
        task = asyncio.get_running_loop().create_task(self.prefiller.release(rid, remote))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def Generate(self, request: worker_pb2.WorkerGenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        rid = request.request_id
        local = await request_from_proto(request, context)
        remote: RemotePrefill | None = None
        if self.prefiller is not None:
            remote = await self.prefiller.plan(rid, local.token_ids, request.sampling, request.prefix_hit_rate)
        else:
            self.metrics.local.inc()
        try:
            if remote is not None:
                started = False
                try:
                    async for msg in self.stream(replace(local, kv_transfer=remote.kv_transfer),
                                                  remote_prefill(remote.worker_id)):
                        if not started and msg.finish_reason == "abort":
                            raise RuntimeError("the engine aborted the request it was to decode from remote KV")
                        started = True
                        yield msg
                    return
                except asyncio.CancelledError:
                    if not started:  # the client left before the KV was pulled: free it now
                        self._release_later(rid, remote)
                    raise
                except Exception as exc:  # noqa: BLE001 - any failure before output means: prefill here
                    if started:
                        raise
                    assert self.prefiller is not None
                    self.prefiller.fallback(rid, "transfer", f"KV from {remote.worker_id} unusable: {exc}")
                    await self.prefiller.release(rid, remote)
            async for msg in self.stream(local, LOCAL_PREFILL):
                yield msg
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
