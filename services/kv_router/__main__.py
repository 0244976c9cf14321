"""python -m services.kv_router: the routing service (and `replay`, its offline twin)."""

from __future__ import annotations

import asyncio
import logging
import sys

from prometheus_client import CollectorRegistry

from gen.kvmesh.v1 import router_pb2, router_pb2_grpc
from services.contract.worker_roles import RoleName
from services.routing.admission.admission_metrics import AdmissionMetrics
from services.routing.admission.gate import Admission
from services.routing.admission.tenant_policy import PolicyFile
from services.routing.flags import add_router_flags, admission_config, router_config, session_config
from services.routing.router import Router
from services.routing.router_metrics import KvTruthMetrics, RouterMetrics
from services.routing.servicer import RouterServicer
from services.routing.session_store import follow_sessions
from services.routing.worker_pool import SYNC_TIMEOUT_S, WorkerPool
from services.mesh.discovery import DECODE_WORKER, PREFILL_WORKER, ROUTER, InstanceInfo, new_instance_id
from services.mesh.config_error import validated
from services.mesh.flags import (
    FlagParser,
    add_mesh_flags,
    exit_if_checking,
    mesh_config,
    non_negative_float,
    port_number,
)
from services.mesh.grpc_server import ServiceBinding
from services.mesh.logs import setup_logging
from services.mesh.service_runner import ServiceRunner, run_service
from services.mesh.tracing import start_tracing

log = logging.getLogger("kv_router")

POOLS: dict[RoleName, str] = {RoleName.DECODE: DECODE_WORKER, RoleName.PREFILL: PREFILL_WORKER}


def parser() -> FlagParser:
    p = FlagParser(prog="python -m services.kv_router")
    add_mesh_flags(p)
    add_router_flags(p)
    p.add_argument("--port", type=port_number, default=0)
    p.add_argument("--metrics-port", type=port_number, default=0)
    p.add_argument("--sync-timeout", type=non_negative_float, default=SYNC_TIMEOUT_S,
                   help="seconds to wait for every worker's cached blocks before serving")
    return p


async def _sync_indexes(pools: dict[RoleName, WorkerPool], timeout_s: float) -> None:
    """A router joins the mesh only once its index holds the workers' caches (resumed or from a
    snapshot): a fresh or restarted router that answered at once would route blind, sending
    prefix-sharing requests anywhere until the KV events caught up."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    for role, pool in pools.items():
        late = await pool.wait_synced(max(0.0, deadline - asyncio.get_running_loop().time()))
        if late:
            log.warning("serving without the cached blocks of %d %s(s) after %.0fs: %s", len(late), POOLS[role],
                        timeout_s, ", ".join(late))


def main(argv: list[str] | None = None) -> None:
    """The service's command line (`argv`, default the process's own): tests run `--check-config` in process."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["replay"]:
        from services.kv_router.replay import main as replay

        replay(argv[1:])
        return
    args = parser().parse_args(argv)
    mesh = mesh_config(args)
    setup_logging(mesh.log_level, ROUTER, mesh.log_format)
    config = router_config(args)
    admission = admission_config(args)
    sessions = session_config(args)
    policies = validated(lambda: PolicyFile(admission.tenant_policies))
    exit_if_checking(args)

    async def assemble(runner: ServiceRunner) -> None:
        tracing = start_tracing(runner)  # first: torn down last, after the drain's last spans
        await runner.connect_store()
        registry = CollectorRegistry()
        kv_truth = KvTruthMetrics(registry)  # one per registry: both pools' series
        pools: dict[RoleName, WorkerPool] = {}
        for role, component in POOLS.items():
            pool = pools[role] = WorkerPool(await runner.watch_component(component), runner.channels, config.kv_truth,
                                            kv_truth)
            runner.on_teardown(f"stop {component} subscriptions", pool.stop)
        await _sync_indexes(pools, args.sync_timeout)
        routers = await runner.watch_component(ROUTER)
        gate = Admission(pools[RoleName.DECODE], admission, AdmissionMetrics(registry), policies,
                         routers=lambda: max(1, len(routers.instances)))
        runner.watch(asyncio.create_task(gate.follow_policies(), name="tenant policies"), "tenant policies")
        bindings = await follow_sessions(runner, mesh.namespace, sessions)
        servicer = RouterServicer(Router(pools, config, RouterMetrics(registry), gate, bindings), tracing)
        binding = ServiceBinding(router_pb2_grpc.add_RouterServicer_to_server, servicer,
                                 router_pb2.DESCRIPTOR.services_by_name["Router"].full_name)
        port, _ = await runner.serve_grpc([binding], args.port)
        metrics_port = runner.serve_metrics(registry, args.metrics_port)
        info = InstanceInfo(component=ROUTER, instance_id=new_instance_id(), address=f"{mesh.advertise_host}:{port}",
                            metrics_port=metrics_port, extra={"mode": config.mode})
        await runner.register(info)
        log.info("router %s (%s mode) at %s", info.instance_id, config.mode, info.address)

    run_service(ROUTER, mesh, assemble)


if __name__ == "__main__":
    main()
