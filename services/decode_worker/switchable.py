"""A worker that can change role (`--switchable`): both roles' services, gated by a `RoleSwitch`.

It is a decode worker's process (the decode role needs the disaggregation set-up) that also
serves `Prefiller`; `--start-as prefill` registers it in the prefill pool first.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import grpc

from gen.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from services.decode_worker.service import DecodeServicer
from services.engines.base import Engine
from services.mesh.grpc_server import ServiceBinding, abort_with
from services.mesh.session_kind import WORKER_SESSION, CallError, CallInfo
from services.mesh.session_server import SessionHub
from services.prefill_worker.servicer import PREFILLER_SERVICE, PrefillServicer
from services.worker.role_switch import ROLE_CONTROL_SERVICE, RoleSwitch
from services.worker.runtime import WorkerContext, WorkerServices


def add_switch_flags(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    g = parser.add_argument_group("role switching")
    g.add_argument("--switchable", action="store_true",
                   help="serve both roles' services and the RoleControl service, so a planner can move this "
                        "worker between the prefill and decode pools without a restart (needs --kv-transfer nixl)")
    g.add_argument("--start-as", choices=("decode", "prefill"), default="decode",
                   help="the pool a --switchable worker joins first")
    return g


class _GatedDecode(DecodeServicer):
    switch: RoleSwitch

    async def generate(self, request: worker_pb2.WorkerGenerateRequest,
                       call: CallInfo) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        async with self.switch.work("decode"):
            async for msg in super().generate(request, call):
                yield msg


class _GatedPrefill(PrefillServicer):
    def __init__(self, engine: Engine, switch: RoleSwitch, ctx: WorkerContext) -> None:
        super().__init__(engine, ctx.tracing)
        self.switch = switch

    async def Prefill(self, request: worker_pb2.PrefillRequest,  # noqa: N802
                      context: grpc.aio.ServicerContext) -> worker_pb2.PrefillResponse:
        try:
            async with self.switch.work("prefill"):
                return await super().Prefill(request, context)
        except CallError as exc:
            await abort_with(context, exc)


def switchable_services(decode: DecodeServicer, engine: Engine, ctx: WorkerContext) -> WorkerServices:
    """Wraps a decode worker's servicer into a worker that serves either role."""
    switch = RoleSwitch(ctx.args.start_as, ctx.mesh.namespace, ctx.mesh.drain_timeout_s, ctx.log_component)
    decode.__class__ = _GatedDecode  # same state, gated Generate
    decode.switch = switch  # type: ignore[attr-defined]
    decode.sessions = SessionHub(WORKER_SESSION, decode.generate)  # the gated one
    prefill = ServiceBinding(worker_pb2_grpc.add_PrefillerServicer_to_server, _GatedPrefill(engine, switch, ctx),
                             PREFILLER_SERVICE)
    control = ServiceBinding(worker_pb2_grpc.add_RoleControlServicer_to_server, switch, ROLE_CONTROL_SERVICE)
    return WorkerServices(decode, (prefill, control), switch=switch)
