"""Engine flags shared by the worker modules, and the one place engines are built."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from services.common.config import die, positive_float, positive_int
from services.engines.base import Engine
from services.engines.mocker.engine import MockerConfig, MockerEngine
from services.engines.mocker.timing import PRESETS, TimingModel

ENGINES = ("vllm", "mocker")
KV_TRANSFERS = ("none", "nixl")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=ENGINES, default="vllm")
    parser.add_argument("--model", default=None, help="model directory (default: the demo model)")
    parser.add_argument("--served-model-name", default=None, help="default: the model directory's name")
    parser.add_argument("--block-size", type=positive_int, default=None,
                        help="KV block size in tokens (default 16; 32 for vLLM on CPU)")
    parser.add_argument("--num-gpu-blocks", type=positive_int, default=16384, help="mocker: KV blocks per worker")
    parser.add_argument("--speedup", type=positive_float, default=1.0,
                        help="mocker: divides the timing model's durations ('inf' = no compute time)")
    parser.add_argument("--timing", choices=sorted(PRESETS), default="h100-8b",
                        help="mocker: the machine its timing model imitates")
    parser.add_argument("--max-num-seqs", type=positive_int, default=None, help="running requests per worker")
    parser.add_argument("--max-model-len", type=positive_int, default=None)
    parser.add_argument("--kv-transfer", choices=KV_TRANSFERS, default="none",
                        help="nixl: this worker exchanges KV caches with prefill/decode peers over NIXL")
    parser.add_argument("--kv-bytes-per-token", type=positive_int, default=4096,
                        help="mocker: size of the synthetic KV moved per prompt token")


@dataclass(frozen=True)
class EngineSpec:
    engine: str
    model_dir: str
    served_model_name: str
    block_size: int
    num_gpu_blocks: int
    speedup: float
    max_num_seqs: int | None
    max_model_len: int | None
    kv_transfer: str = "none"
    kv_bytes_per_token: int = 4096
    timing: str = "h100-8b"
    advertise_host: str = "127.0.0.1"


def default_block_size(engine: str) -> int:
    if engine == "vllm":
        from services.engines.vllm_engine import on_cpu

        return 32 if on_cpu() else 16
    return 16


def engine_spec(args: argparse.Namespace, advertise_host: str = "127.0.0.1") -> EngineSpec:
    from services.tools.make_demo_model import ensure_demo_model

    model = Path(args.model) if args.model else ensure_demo_model()
    if not (model / "config.json").is_file():
        die(f"--model {model}: no config.json there (expected a Hugging Face model directory)")
    block_size = args.block_size or default_block_size(args.engine)
    if args.engine == "vllm" and block_size % 32 and default_block_size("vllm") == 32:
        die(f"--block-size {block_size}: vLLM on CPU needs a multiple of 32")
    return EngineSpec(
        engine=args.engine,
        model_dir=str(model.resolve()),
        served_model_name=args.served_model_name or model.resolve().name,
        block_size=block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        speedup=args.speedup,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        kv_transfer=args.kv_transfer,
        kv_bytes_per_token=args.kv_bytes_per_token,
        timing=args.timing,
        advertise_host=advertise_host,
    )


def build_engine(spec: EngineSpec) -> Engine:
    if spec.engine == "mocker":
        return MockerEngine(
            MockerConfig(
                model_dir=spec.model_dir,
                served_model_name=spec.served_model_name,
                block_size=spec.block_size,
                num_gpu_blocks=spec.num_gpu_blocks,
                max_num_seqs=spec.max_num_seqs or 256,
                timing=TimingModel.preset(spec.timing, spec.speedup),
                kv_bytes_per_token=spec.kv_bytes_per_token,
            )
        )
    from services.engines.vllm_engine import VllmConfig, VllmEngine, nixl_transfer_config

    return VllmEngine(
        VllmConfig(
            model_dir=spec.model_dir,
            served_model_name=spec.served_model_name,
            block_size=spec.block_size,
            max_model_len=spec.max_model_len,
            max_num_seqs=spec.max_num_seqs or 64,
            cpu_kv_cache_gib=int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")),
            kv_transfer=nixl_transfer_config(spec.advertise_host) if spec.kv_transfer == "nixl" else None,
        )
    )
