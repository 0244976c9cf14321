"""python -m services.decode_worker: a generation worker (vLLM or mocker) joining the mesh.

With `--kv-transfer nixl` it prefills long prompts on the prefill pool (see disagg_decision.py).
"""

from __future__ import annotations

import argparse
import dataclasses

from services.decode_worker.flags import DrainMode, add_disagg_flags, add_drain_flags, disagg_config
from services.decode_worker.switchable import add_switch_flags, role_switch, switchable_services
from services.mesh.flags import die
from services.worker.engine_flags import EngineConfig
from services.decode_worker.remote_prefill import DisaggMetrics, RemotePrefiller
from services.decode_worker.service import DecodeServicer
from services.engines.base import Engine
from services.mesh.discovery import DECODE_WORKER, ROUTER
from services.routing.router_client import RouterClient
from services.worker.kv_event_log import KvEventLog
from services.contract.worker_roles import RoleName
from services.worker.handoff import MoveMetrics, hand_over, move_away
from services.worker.remote_encode import remote_encoder
from services.worker.role_switch import always
from services.worker.runtime import Role, ServicesFactory, WorkerContext, WorkerServices, main


async def prepare(ctx: WorkerContext) -> ServicesFactory:
    """Per process: the disaggregation rule, its metrics, and a router client for the prefill pool."""
    config = disagg_config(ctx.args, can_receive_kv=ctx.engine.kv_transfer == "nixl")
    metrics = DisaggMetrics(ctx.registry)
    moves = MoveMetrics(ctx.registry)
    encoder = await remote_encoder(ctx.engine.kv_transfer, ctx.args, ctx.runner, ctx.registry)
    prefiller = None
    if config.remote_prefill:
        routers = RouterClient(await ctx.runner.watch_component(ROUTER), ctx.runner.sessions)
        prefiller = RemotePrefiller(config, ctx.engine.served_model_name, routers, ctx.runner.sessions,
                                    ctx.runner.channels, metrics, ctx.tracing)

    def services(engine: Engine, worker_id: str, events: KvEventLog) -> WorkerServices:
        engine.set_kv_transfer_sink(metrics.record_transfer)
        switch = role_switch(ctx) if ctx.args.switchable else None
        decode = DecodeServicer(engine, worker_id, events, prefiller, metrics, ctx.tracing,
                                ctx.args.stream_interval_ms / 1000, admit=switch.work if switch else always,
                                encoder=encoder, moves=moves)
        built = WorkerServices(decode) if switch is None else switchable_services(decode, switch, engine, ctx,
                                                                                  encoder)
        if ctx.args.drain_mode is DrainMode.MOVE and engine.can_move:
            built = dataclasses.replace(built, drain=lambda: move_away(engine, worker_id, ctx.mesh.drain_timeout_s,
                                                                       moves, lambda: decode.running_ids))
            if switch is not None:
                switch.hand_over = lambda: hand_over(engine, frozenset(decode.running_ids), moves)
        return built

    return services


def add_flags(parser: argparse.ArgumentParser) -> None:
    add_disagg_flags(parser)
    add_drain_flags(parser)
    add_switch_flags(parser)


def check_flags(args: argparse.Namespace, spec: EngineConfig) -> None:
    disagg_config(args, can_receive_kv=spec.kv_transfer == "nixl")
    if args.switchable and spec.kv_transfer != "nixl":
        die("--switchable needs --kv-transfer nixl (the prefill role hands its KV over NIXL)")
    if args.start_as != RoleName.DECODE and not args.switchable:
        die("--start-as needs --switchable")


ROLE = Role(DECODE_WORKER, RoleName.DECODE, prepare, add_flags, check_flags=check_flags)

if __name__ == "__main__":
    main(ROLE)
