"""A worker that can change role (`--switchable`): both roles' services, each gated by a
`RoleSwitch` (composition: the servicers take the switch's admission; nothing is subclassed).

It is a decode worker's process (the decode role needs the disaggregation set-up) that also
serves `Prefiller`; `--start-as prefill` registers it in the prefill pool first.
"""

from __future__ import annotations

import argparse

from gen.kvmesh.v1 import worker_pb2_grpc
from services.engines.base import Engine
from services.mesh.grpc_server import ServiceBinding
from services.worker.prefill_servicer import PREFILLER_SERVICE, PrefillServicer
from services.worker.remote_encode import RemoteEncoder
from services.contract.worker_roles import RoleName
from services.worker.role_switch import ROLE_CONTROL_SERVICE, RoleSwitch
from services.worker.runtime import WorkerContext, WorkerServices
from services.worker.servicer import WorkerServicer


def add_switch_flags(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    g = parser.add_argument_group("role switching")
    g.add_argument("--switchable", action="store_true",
                   help="serve both roles' services and the RoleControl service, so a planner can move this "
                        "worker between the prefill and decode pools without a restart (needs --kv-transfer nixl)")
    g.add_argument("--start-as", type=RoleName, choices=(RoleName.DECODE, RoleName.PREFILL), default=RoleName.DECODE,
                   help="the pool a --switchable worker joins first")
    return g


def role_switch(ctx: WorkerContext) -> RoleSwitch:
    """One worker's switch; its `work` admits the calls of the role it serves now."""
    return RoleSwitch(ctx.args.start_as, ctx.mesh.drain_timeout_s, ctx.log_component)


def switchable_services(decode: WorkerServicer, switch: RoleSwitch, engine: Engine, ctx: WorkerContext,
                        encoder: RemoteEncoder | None = None) -> WorkerServices:
    """A decode servicer built with `switch.work` as its admission, beside a prefill servicer
    gated the same way and the RoleControl service that moves the worker."""
    prefill = ServiceBinding(worker_pb2_grpc.add_PrefillerServicer_to_server,
                             PrefillServicer(engine, ctx.tracing, admit=switch.work, encoder=encoder), PREFILLER_SERVICE)
    control = ServiceBinding(worker_pb2_grpc.add_RoleControlServicer_to_server, switch, ROLE_CONTROL_SERVICE)
    return WorkerServices(decode, (prefill, control), switch=switch)
