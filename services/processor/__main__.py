"""python -m services.processor: tokenization, routing and detokenization for one model."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from gen.kvmesh.v1 import processor_pb2, processor_pb2_grpc
from services.common.config import FlagParser, add_mesh_flags, die, mesh_config, positive_int, setup_logging
from services.common.discovery import PROCESSOR, ROUTER, ComponentView, InstanceInfo, new_instance_id
from services.common.grpc_server import ChannelPool, ServiceBinding, start_server
from services.common.lifecycle import connect_store, register_instance, run, stop_event_on_signals
from services.processor.service import ProcessorConfig, ProcessorServicer
from services.processor.tokenizer import ModelTokenizer

log = logging.getLogger("processor")


def parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="python -m services.processor")
    add_mesh_flags(p)
    p.add_argument("--model", default=None, help="model directory (default: the demo model)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--request-timeout", type=positive_int, default=600, help="seconds one generation may take")
    return p


def main() -> None:
    args = parser().parse_args()
    mesh = mesh_config(args)
    setup_logging(mesh.log_level, PROCESSOR)
    from services.tools.make_demo_model import ensure_demo_model

    model = Path(args.model) if args.model else ensure_demo_model()
    if not (model / "config.json").is_file():
        die(f"--model {model}: no config.json there")
    served = args.served_model_name or model.resolve().name
    tokenizer = ModelTokenizer(str(model))
    config = ProcessorConfig(served_model_name=served, request_timeout_s=float(args.request_timeout))

    async def amain() -> None:
        stop = stop_event_on_signals()
        store = await connect_store(mesh)
        channels = ChannelPool()
        routers = ComponentView(store, mesh.namespace, ROUTER)
        await routers.start()
        servicer = ProcessorServicer(config, tokenizer, routers, channels)
        binding = ServiceBinding(processor_pb2_grpc.add_ProcessorServicer_to_server, servicer,
                                 processor_pb2.DESCRIPTOR.services_by_name["Processor"].full_name)
        server, port, _ = await start_server([binding], mesh.host, args.port)
        info = InstanceInfo(component=PROCESSOR, instance_id=new_instance_id(), address=f"{mesh.advertise_host}:{port}",
                            model=served, extra={"max_model_len": tokenizer.max_model_len})
        registration = await register_instance(store, mesh.namespace, info)
        log.info("processor %s for %s at %s", info.instance_id, served, info.address)
        await stop.wait()
        await registration.stop()
        await server.stop(grace=2)
        await routers.stop()
        await channels.close()
        await store.close()

    run(amain)


if __name__ == "__main__":
    main()
