"""The decode worker's Generate: decide where the prefill runs, then generate.

A request whose remote prefill succeeded is generated from the pulled KV; if that fails before
the first token (the KV cannot be pulled, the engine rejects it), the request is generated from
scratch locally instead — counted as a fallback — so no request is lost to the prefill pool.
A request a draining decode worker handed over with its KV (`moved_kv`, worker/handoff.py) is
decoded from that KV the same way, and recomputed here if it cannot be pulled.

Traced as a `decode` span with, under it, `remote prefill` (remote_prefill.py) and `kv transfer`:
from handing the engine the prefill worker's KV parameters to the engine's first output. Both
engines pull the KV before that output (the mocker within the request, vLLM's connector before
it schedules the request), so the span bounds the pull; where the engine reports the transfer
within the request (the mocker), its bytes and seconds are on the span too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import replace


from gen.kvmesh.v1 import worker_pb2
from services.decode_worker.disagg_decision import absolute_prefill_length
from services.decode_worker.remote_prefill import DisaggMetrics, RemotePrefill, RemotePrefiller
from services.engines.base import Engine
from services.engines.lora import AdapterError
from services.mesh.session_kind import CallInfo, TokenRow
from services.mesh.tasks import cancel_and_wait
from services.mesh.tracing import TRACING_OFF, Tracing
from services.mesh.logs import REQUEST_ID
from services.contract.worker_roles import RoleName
from services.worker.kv_event_log import KvEventLog
from services.worker.lora_adapters import adapter_refused
from services.worker.handoff import MoveMetrics
from services.worker.kv_pull import kv_pull_from_proto
from services.worker.pacing import DEFAULT_INTERVAL_S
from services.worker.remote_encode import RemoteEncoder
from services.worker.role_switch import Admit, always
from services.worker.servicer import (
    GENERATE_RPC,
    GenerateReply,
    LOCAL_PREFILL,
    WorkerServicer,
    generate_attributes,
    refused,
    remote_prefill,
)

log = logging.getLogger(__name__)


class DecodeServicer(WorkerServicer):
    def __init__(self, engine: Engine, worker_id: str, events: KvEventLog, prefiller: RemotePrefiller | None,
                 metrics: DisaggMetrics, tracing: Tracing = TRACING_OFF,
                 stream_interval_s: float = DEFAULT_INTERVAL_S, admit: Admit = always,
                 encoder: RemoteEncoder | None = None, moves: MoveMetrics | None = None) -> None:
        """`admit` gates each call by role (a worker that can switch roles decodes only in the
        decode role); `encoder`: the encode pool's client, for images this worker prefills;
        `moves`: where requests moved here are counted (handoff.py)."""
        super().__init__(engine, worker_id, events, tracing, stream_interval_s, metrics.hops)
        self.admit = admit
        self.prefiller = prefiller
        self.encoder = encoder
        self.metrics = metrics
        self.moves = moves
        # Releases of KV we abandoned, sent after our own request was cancelled: owned here.
        self._releases: set[asyncio.Task[None]] = set()
        # The engine ids of the decode calls in flight: what a role switch hands over.
        self.running_ids: set[str] = set()

    async def stop(self) -> None:
        await cancel_and_wait(*self._releases)

    def _release_later(self, rid: str, remote: RemotePrefill) -> None:
        assert self.prefiller is not None
        task = asyncio.get_running_loop().create_task(self.prefiller.release(rid, remote))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def generate(self, request: worker_pb2.WorkerGenerateRequest,
                       call: CallInfo) -> AsyncIterator[GenerateReply]:
        REQUEST_ID.set(request.request_id)  # this call's task: its log lines carry the id
        async with self.admit(RoleName.DECODE):
            with self.tracing.server_span("decode", call, GENERATE_RPC) as span:
                if span.is_recording():
                    span.set_attributes(generate_attributes(request, self.worker_id))
                self.running_ids.add(request.request_id)
                try:
                    async for msg in self._generate(request, call.reply):
                        yield msg
                except ValueError as exc:
                    raise refused(exc) from exc
                except AdapterError as exc:  # forgotten between the check and the engine's `use`
                    raise adapter_refused(exc) from exc
                finally:
                    self.running_ids.discard(request.request_id)

    async def _generate(self, request: worker_pb2.WorkerGenerateRequest,
                        reply: Callable[[TokenRow], None] | None) -> AsyncIterator[GenerateReply]:
        """`reply`: see WorkerServicer.stream (this generator hands on what it gets at once)."""
        rid = request.request_id
        local = self.engine_request(request)
        remote: RemotePrefill | None = None
        if request.moved_kv.HasField("params"):  # handed over by a draining worker: its KV is there
            remote = RemotePrefill(request.moved_from, "", kv_pull_from_proto(request.moved_kv), moved=True)
        elif self.prefiller is not None:
            # The prefill worker computes the prompt's KV with the same adapter as this one decodes.
            remote = await self.prefiller.plan(rid, local.token_ids, request.sampling, request.prefix_hit_rate,
                                               local.lora_name, request.media)
        else:
            self.metrics.prefilled(False, absolute_prefill_length(len(local.token_ids), request.prefix_hit_rate))
        if remote is not None:
            started = False
            try:
                outputs = self.stream(replace(local, kv_pull=remote.kv_pull), remote_prefill(remote.worker_id),
                                      reply)
                async with aclosing(outputs):
                    # Current while the engine pulls, so what it reports of the transfer lands on it.
                    with self.tracing.span("kv transfer") as transfer:
                        if transfer.is_recording():
                            transfer.set_attribute("kvmesh.prefill_worker_id", remote.worker_id)
                        first = await anext(outputs, None)
                        if first is None:
                            return
                        # A generation's first reply is always a message (WorkerServicer.stream); an
                        # engine that dropped the request raised CallError (PEER_FAILED) instead.
                        assert not isinstance(first, list)
                    started = True
                    if remote.moved and self.moves is not None:
                        self.moves.moved_in.labels("pulled").inc()
                    yield first
                    async for msg in outputs:
                        yield msg
                return
            except asyncio.CancelledError:
                if not started and not remote.moved:  # the client left before the KV was pulled: free it now
                    self._release_later(rid, remote)
                raise
            except Exception as exc:  # noqa: BLE001 - any failure before output means: prefill here
                if started:
                    raise
                await self._unusable(rid, remote, exc, request)
        if self.encoder is not None:
            await self.encoder.prepare(self.engine, local)  # prefilled here: its images encoded on the pool
        async for msg in self.stream(local, LOCAL_PREFILL, reply):
            yield msg

    async def _unusable(self, rid: str, remote: RemotePrefill, exc: Exception,
                        request: worker_pb2.WorkerGenerateRequest) -> None:
        """The pulled KV could not be used: the request is computed here instead (a moved
        request's KV, held by a draining worker, expires there by itself)."""
        if remote.moved:
            log.warning("request %s: the KV handed over by %s is unusable (%s); recomputing it here", rid,
                        remote.worker_id, exc)
            if self.moves is not None:
                self.moves.moved_in.labels("recomputed").inc()
            return
        assert self.prefiller is not None
        self.prefiller.fallback(rid, "transfer", f"KV from {remote.worker_id} unusable: {exc}")
        self.metrics.prefilled(False, absolute_prefill_length(len(request.token_ids), request.prefix_hit_rate))
        await self.prefiller.release(rid, remote)
