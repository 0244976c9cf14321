"""python -m services.planner: sizes the prefill and decode pools and switches worker roles (and,
with `--max-encode-workers`, sizes the encode pool).

Every `--adjustment-interval` it measures the traffic at the frontends, predicts TTFT and ITL
for candidate pool sizes, and plans the sizes that meet `--ttft-slo-ms` and `--itl-slo-ms`
(policy.py); the connector carries the plan out: `none` (the default: log and export only),
`local` (a launcher's workers: switch roles, start, stop) or `kubernetes` (scale the worker
Deployments). Decisions are logged one line each and exported as `kvmesh_planner_*`.

`python -m services.planner profile ...` measures a worker and writes the profile the planner
predicts from (profiler.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from prometheus_client import CollectorRegistry

from services.mesh.discovery import (
    DECODE_WORKER,
    ENCODE_WORKER,
    FRONTEND,
    PLANNER,
    PREFILL_WORKER,
    ROUTER,
    ComponentView,
    InstanceInfo,
    new_instance_id,
)
from services.mesh.flags import FlagParser, add_mesh_flags, die, exit_if_checking, mesh_config, port_number
from services.mesh.logs import setup_logging
from services.mesh.service_runner import ServiceRunner, run_service
from services.planner.connectors.base import Connector
from services.planner.connectors.none import DryRun
from services.planner.flags import add_connector_flags, add_planner_flags, planner_config
from services.planner.metrics import PlannerMetrics
from services.planner.planner import Planner
from services.planner.policy import Policy
from services.planner.traffic import MeshTraffic

log = logging.getLogger("planner")


def parser() -> FlagParser:
    p = FlagParser(prog="python -m services.planner")
    add_mesh_flags(p)
    add_planner_flags(p)
    add_connector_flags(p)
    p.add_argument("--metrics-port", type=port_number, default=0, help="Prometheus /metrics and /health (0 = any free)")
    return p


def check_connector_flags(args: argparse.Namespace) -> None:
    if args.connector == "local" and not args.launcher:
        die("--connector local needs --launcher HOST:PORT (services.launch --planner local passes it)")
    if args.connector == "kubernetes" and args.max_encode_workers:
        die("--max-encode-workers with --connector kubernetes: the kubernetes connector does not scale an encode "
            "Deployment yet")
    if args.connector == "kubernetes":
        from services.mesh.config_error import validated
        from services.planner.connectors.kubernetes import KubernetesTarget

        validated(lambda: KubernetesTarget(args.k8s_namespace, args.k8s_prefill_deployment, args.k8s_decode_deployment))


async def build_connector(args: argparse.Namespace, runner: ServiceRunner, prefill: ComponentView,
                          decode: ComponentView, encode: ComponentView | None) -> Connector:
    if args.connector == "local":
        from services.planner.connectors.local import LocalConnector

        return LocalConnector(args.launcher, runner.channels, prefill, decode, runner.drain_timeout_s, encode)
    if args.connector == "kubernetes":
        from services.planner.connectors.kubernetes import KubernetesTarget, from_environment

        return from_environment(KubernetesTarget(args.k8s_namespace, args.k8s_prefill_deployment,
                                                 args.k8s_decode_deployment))
    return DryRun()


def main(argv: list[str] | None = None) -> None:
    """The service's command line (`argv`, default the process's own): tests run `--check-config` in process."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["profile"]:
        from services.planner.profiler import main as profile

        profile(argv[1:])
        return
    args = parser().parse_args(argv)
    mesh = mesh_config(args)
    setup_logging(mesh.log_level, PLANNER, mesh.log_format)
    config = planner_config(args)
    check_connector_flags(args)
    exit_if_checking(args)

    async def assemble(runner: ServiceRunner) -> None:
        await runner.connect_store()
        prefill = await runner.watch_component(PREFILL_WORKER)
        decode = await runner.watch_component(DECODE_WORKER)
        encode = await runner.watch_component(ENCODE_WORKER) if config.limits.encode.sized else None
        traffic = MeshTraffic(await runner.watch_component(FRONTEND), decode, await runner.watch_component(ROUTER),
                              prefill, encode)
        runner.on_teardown("close the metrics reader", traffic.close)
        connector = await build_connector(args, runner, prefill, decode, encode)
        runner.on_teardown(f"close the {connector.name} connector", connector.close)
        registry = CollectorRegistry()
        planner = Planner(Policy(config.cost, config.slo, config.limits), traffic, prefill, decode, connector,
                          PlannerMetrics(registry, encode is not None), config.interval_s, encode)
        metrics_port = runner.serve_metrics(registry, args.metrics_port)
        runner.watch(asyncio.create_task(planner.run(), name="planner"), "the planning loop")
        info = InstanceInfo(component=PLANNER, instance_id=new_instance_id(), metrics_port=metrics_port,
                            extra={"connector": connector.name})
        await runner.register(info)
        log.info("planner %s planning with the %s connector every %.0fs (TTFT SLO %.0f ms, ITL SLO %.0f ms)",
                 info.instance_id, connector.name, config.interval_s, config.slo.ttft_s * 1000,
                 config.slo.itl_s * 1000)

    run_service(PLANNER, mesh, assemble)


if __name__ == "__main__":
    main()
