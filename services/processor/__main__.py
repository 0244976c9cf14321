"""python -m services.processor: tokenization, routing and detokenization for one model."""

from __future__ import annotations

from services.mesh.discovery import PROCESSOR
from services.mesh.flags import (
    FlagParser,
    add_mesh_flags,
    add_model_flags,
    exit_if_checking,
    mesh_config,
    port_number,
)
from services.mesh.logs import setup_logging
from services.mesh.service_runner import ServiceRunner, run_service
from services.mesh.tracing import start_tracing
from services.processor.assembly import processor_settings, start_processor
from services.processor.flags import add_processor_flags
from services.routing.flags import add_router_flags


def parser() -> FlagParser:
    p = FlagParser(prog="python -m services.processor")
    add_mesh_flags(p)
    add_model_flags(p)
    add_processor_flags(p)
    add_router_flags(p)  # for --routing local
    p.add_argument("--port", type=port_number, default=0)
    p.add_argument("--metrics-port", type=port_number, default=0, help="Prometheus port (0 = any free)")
    return p


def main(argv: list[str] | None = None) -> None:
    """The service's command line (`argv`, default the process's own): tests run `--check-config` in process."""
    args = parser().parse_args(argv)
    mesh = mesh_config(args)
    setup_logging(mesh.log_level, PROCESSOR, mesh.log_format)
    settings = processor_settings(args)
    exit_if_checking(args)

    async def assemble(runner: ServiceRunner) -> None:
        tracing = start_tracing(runner)  # first: torn down last, after the drain's last spans
        await start_processor(runner, args, settings, mesh, tracing, args.port, args.metrics_port)

    run_service(PROCESSOR, mesh, assemble)


if __name__ == "__main__":
    main()
