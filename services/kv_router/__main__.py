"""python -m services.kv_router: the routing service (and, later, its offline `replay` tool)."""

from __future__ import annotations

import argparse
import logging
import sys

from prometheus_client import CollectorRegistry

from gen.kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.common.config import FlagParser, add_mesh_flags, die, mesh_config, setup_logging
from services.common.discovery import (
    DECODE_WORKER,
    PREFILL_WORKER,
    ROUTER,
    ComponentView,
    InstanceInfo,
    new_instance_id,
)
from services.common.grpc_server import ChannelPool, ServiceBinding, start_server
from services.common.lifecycle import connect_store, register_instance, run, stop_event_on_signals
from services.common.telemetry import serve_metrics
from services.kv_router.cost_function import CostWeights
from services.kv_router.service import ROUTER_MODES, RouterConfig, RouterMetrics, RouterServicer
from services.kv_router.worker_pool import WorkerPool

log = logging.getLogger("kv_router")


def parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="python -m services.kv_router")
    add_mesh_flags(p)
    p.add_argument("--router-mode", choices=ROUTER_MODES, default="kv")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--metrics-port", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="seed for random tie-breaking (reproducible runs)")
    p.add_argument("--overlap-weight", type=float, default=2.0, help="cost function: weight of the cached share")
    p.add_argument("--cache-usage-weight", type=float, default=1.0, help="cost function: weight of KV cache usage")
    p.add_argument("--waiting-weight", type=float, default=1.0, help="cost function: weight of the normalized queue")
    p.add_argument("--router-temperature", type=float, default=0.0,
                   help="0 = best logit wins; > 0 = sample from softmax(logit / T)")
    return p


def main() -> None:
    if sys.argv[1:2] == ["replay"]:
        from services.kv_router.replay import main as replay

        replay(sys.argv[2:])
        return
    args = parser().parse_args()
    mesh = mesh_config(args)
    setup_logging(mesh.log_level, ROUTER)
    if args.router_temperature < 0:
        die("--router-temperature must be >= 0")
    weights = CostWeights(overlap=args.overlap_weight, cache_usage=args.cache_usage_weight,
                          waiting=args.waiting_weight, temperature=args.router_temperature)
    config = RouterConfig(mode=args.router_mode, seed=args.seed, weights=weights)

    async def amain() -> None:
        stop = stop_event_on_signals()
        store = await connect_store(mesh)
        channels = ChannelPool()
        registry = CollectorRegistry()
        pools: dict[int, WorkerPool] = {
            common_pb2.WORKER_ROLE_DECODE: WorkerPool(ComponentView(store, mesh.namespace, DECODE_WORKER), channels),
            common_pb2.WORKER_ROLE_PREFILL: WorkerPool(ComponentView(store, mesh.namespace, PREFILL_WORKER), channels),
        }
        for pool in pools.values():
            await pool.view.start()
        servicer = RouterServicer(pools, config, RouterMetrics(registry))
        binding = ServiceBinding(router_pb2_grpc.add_RouterServicer_to_server, servicer,
                                 router_pb2.DESCRIPTOR.services_by_name["Router"].full_name)
        server, port, _ = await start_server([binding], mesh.host, args.port)
        metrics_port = serve_metrics(registry, mesh.host, args.metrics_port)
        instance_id = new_instance_id()
        info = InstanceInfo(component=ROUTER, instance_id=instance_id, address=f"{mesh.advertise_host}:{port}",
                            metrics_port=metrics_port, extra={"mode": config.mode})
        registration = await register_instance(store, mesh.namespace, info)
        log.info("router %s (%s mode) at %s", instance_id, config.mode, info.address)
        await stop.wait()
        await registration.stop()
        await server.stop(grace=2)
        for pool in pools.values():
            await pool.stop()
            await pool.view.stop()
        await channels.close()
        await store.close()

    run(amain)


if __name__ == "__main__":
    main()
