"""python -m services.frontend: the OpenAI-compatible REST gateway."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket

import uvicorn

from services.common.config import FlagParser, add_mesh_flags, die, mesh_config, positive_int, setup_logging
from services.common.discovery import FRONTEND, InstanceInfo, new_instance_id
from services.common.lifecycle import connect_store, register_instance, run, stop_event_on_signals
from services.frontend.app import FrontendConfig, create_app
from services.frontend.mesh import MeshView
from services.frontend.metrics import FrontendMetrics

log = logging.getLogger("frontend")


def parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="python -m services.frontend")
    add_mesh_flags(p)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("KVMESH_API_KEY") or None,
                   help="require this bearer token (env KVMESH_API_KEY)")
    p.add_argument("--max-body-bytes", type=positive_int, default=16 * 1024 * 1024)
    p.add_argument("--max-inflight", type=positive_int, default=2048, help="concurrent requests before 429")
    return p


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the service's stop event decides when to exit."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        die(f"--http-port {port}: cannot listen on {host}:{port} ({exc.strerror})")
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def main() -> None:
    args = parser().parse_args()
    mesh = mesh_config(args)
    setup_logging(mesh.log_level, FRONTEND)
    sock = bind(mesh.host, args.http_port)
    config = FrontendConfig(api_key=args.api_key, max_body_bytes=args.max_body_bytes, max_inflight=args.max_inflight)

    async def amain() -> None:
        stop = stop_event_on_signals()
        store = await connect_store(mesh)
        view = MeshView(store, mesh.namespace)
        await view.start()
        metrics = FrontendMetrics()
        app = create_app(config, view, metrics)
        server = _Server(uvicorn.Config(app, log_level="warning", access_log=False, http="httptools",
                                        timeout_keep_alive=30, lifespan="off"))
        port = sock.getsockname()[1]
        info = InstanceInfo(component=FRONTEND, instance_id=new_instance_id(), address=f"{mesh.advertise_host}:{port}")
        registration = await register_instance(store, mesh.namespace, info)
        serving = asyncio.create_task(server.serve(sockets=[sock]), name="http")
        log.info("frontend %s listening on http://%s:%d/v1", info.instance_id, mesh.host, port)
        stopping = asyncio.create_task(stop.wait(), name="stop-signal")
        await asyncio.wait([serving, stopping], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        server.should_exit = True
        await asyncio.gather(serving, return_exceptions=True)
        await registration.stop()
        await view.stop()
        await store.close()

    run(amain)


if __name__ == "__main__":
    main()
