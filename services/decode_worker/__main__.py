"""python -m services.decode_worker: a generation worker (vLLM or mocker) joining the mesh.

With `--kv-transfer nixl` it prefills long prompts on the prefill pool (see disagg_decision.py).
"""

from __future__ import annotations

import argparse

from services.common.config import die, non_negative_int, positive_float
from services.common.discovery import DECODE_WORKER, ROUTER, ComponentView
from services.common.grpc_server import ChannelPool
from services.common.kv_event_log import KvEventLog
from services.common.worker_runtime import Role, WorkerContext, main
from services.decode_worker.disagg_decision import DisaggConfig
from services.decode_worker.remote_prefill import DisaggMetrics, RemotePrefiller
from services.decode_worker.service import DecodeServicer
from services.engines.base import Engine


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--remote-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="prefill long prompts on prefill workers (default: on with --kv-transfer nixl)")
    p.add_argument("--conditional-disagg", action=argparse.BooleanOptionalAction, default=True,
                   help="remote only for long uncached prompts and a short prefill queue (off: always remote)")
    p.add_argument("--max-local-prefill-length", type=non_negative_int, default=512,
                   help="uncached prompt tokens above which the prefill goes remote")
    p.add_argument("--max-prefill-queue-size", type=non_negative_int, default=2,
                   help="prefill pool queue at which prompts are prefilled locally instead")
    p.add_argument("--prefill-timeout", type=positive_float, default=30.0,
                   help="seconds a remote prefill may take before the prompt is prefilled locally")


class DecodeRole:
    """Per-process state of decode workers: the router view for picking prefill workers."""

    def __init__(self) -> None:
        self.routers: ComponentView | None = None
        self.channels = ChannelPool()
        self.metrics: DisaggMetrics | None = None
        self.config: DisaggConfig | None = None

    async def setup(self, ctx: WorkerContext) -> None:
        args = ctx.args
        remote = args.remote_prefill if args.remote_prefill is not None else args.kv_transfer == "nixl"
        if remote and args.kv_transfer != "nixl":
            die("--remote-prefill needs --kv-transfer nixl (the KV cache has to come over NIXL)")
        self.config = DisaggConfig(remote_prefill=remote, conditional_disagg=args.conditional_disagg,
                                   max_local_prefill_length=args.max_local_prefill_length,
                                   max_prefill_queue_size=args.max_prefill_queue_size,
                                   prefill_timeout_s=args.prefill_timeout)
        self.metrics = DisaggMetrics(ctx.registry)
        if remote:
            self.routers = ComponentView(ctx.store, ctx.mesh.namespace, ROUTER)
            await self.routers.start()

    def servicer(self, engine: Engine, worker_id: str, events: KvEventLog, ctx: WorkerContext) -> DecodeServicer:
        assert self.metrics is not None and self.config is not None
        engine.set_kv_transfer_sink(self.metrics.record_transfer)
        prefiller = None
        if self.routers is not None:
            prefiller = RemotePrefiller(self.config, ctx.spec.served_model_name, self.routers, self.channels, self.metrics)
        return DecodeServicer(engine, worker_id, events, prefiller, self.metrics)

    async def teardown(self) -> None:
        if self.routers is not None:
            await self.routers.stop()
        await self.channels.close()


if __name__ == "__main__":
    state = DecodeRole()
    main(Role(DECODE_WORKER, "decode", state.servicer, add_flags, state.setup, state.teardown))
