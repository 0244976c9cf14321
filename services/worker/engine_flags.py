"""The engine flags, declared once for the worker modules and the launcher, and their config.

The mocker's defaults (KV capacity, timing preset, synthetic KV size) come from the mocker
itself; the block size rule lives here: 16, except 32 for vLLM on CPU, whose attention needs a
multiple of 32.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.engines.lora import LORA_OFF, LoraConfig, LoraModule
from services.engines.mocker.config import MockerConfig
from services.config_error import ConfigError
from services.mesh.config_error import validated
from services.mesh.flags import (
    ModelRef,
    add_model_flags,
    model_ref,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from services.profiles.cost_model import ProfileError
from services.profiles.profile_file import DEFAULT_PRESET, load_profile, preset_names
from services.worker.pacing import DEFAULT_INTERVAL_S
from services.worker.remote_encode import EncodeConfig

ENGINES = ("vllm", "mocker")
KV_TRANSFERS = ("none", "nixl")
# The mocker's own defaults, surfaced as flags.
DEFAULT_TIMING = DEFAULT_PRESET
DEFAULT_NUM_GPU_BLOCKS = MockerConfig.num_gpu_blocks
DEFAULT_KV_BYTES_PER_TOKEN = MockerConfig.kv_bytes_per_token
DEFAULT_HOST_KV_GBPS = MockerConfig.host_kv_gbps
DEFAULT_SESSION_PIN_BLOCKS = MockerConfig.session_pin_blocks


@dataclass(frozen=True)
class EngineConfig:
    engine: str
    model: ModelRef
    block_size: int
    num_gpu_blocks: int = DEFAULT_NUM_GPU_BLOCKS
    speedup: float = 1.0
    timing: str = DEFAULT_TIMING
    # A profile file the mocker runs as its timing instead of the `timing` preset.
    timing_profile: str | None = None
    # None: the engine's own default (256 running requests on the mocker, 64 on vLLM).
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    # mocker: answers end after this many tokens (0: at max_tokens).
    answer_tokens: int = 0
    # "nixl": this worker exchanges prompt KV with peers of the other role.
    kv_transfer: str = "none"
    # The address NIXL peers use to reach this worker.
    advertise_host: str = "127.0.0.1"
    # A host-memory KV tier of this many blocks (0: none), and its host -> device link in GB/s.
    host_kv_blocks: int = 0
    host_kv_gbps: float = DEFAULT_HOST_KV_GBPS
    lora: LoraConfig = LORA_OFF
    # Device blocks the mocker keeps pinned for idle agent sessions (-1: a quarter of the device).
    session_pin_blocks: int = DEFAULT_SESSION_PIN_BLOCKS
    # vLLM's encode stage (E/P/D): the directory encode workers write image features to and the
    # workers that prefill read them from (one host, or a filesystem they share); None: off.
    encoder_cache_dir: str | None = None
    # This worker is an encode worker (its role says so, not a flag): vLLM runs its encoder only.
    encodes: bool = False

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"--engine {self.engine!r} is not one of {', '.join(ENGINES)}")
        if self.kv_transfer not in KV_TRANSFERS:
            raise ConfigError(f"--kv-transfer {self.kv_transfer!r} is not one of {', '.join(KV_TRANSFERS)}")
        if self.timing not in preset_names():
            raise ConfigError(f"--timing {self.timing!r} is not one of {', '.join(preset_names())}")
        if self.timing_profile is not None:
            try:
                load_profile(self.timing_profile)
            except ProfileError as exc:
                raise ConfigError(f"--timing-profile: {exc}") from exc
        for flag, value in (("--block-size", self.block_size), ("--num-gpu-blocks", self.num_gpu_blocks),
                            ("--kv-bytes-per-token", self.kv_bytes_per_token)):
            if value <= 0:
                raise ConfigError(f"{flag} must be > 0, got {value}")
        if not self.speedup > 0:
            raise ConfigError(f"--speedup must be > 0, got {self.speedup}")
        if self.engine == "vllm" and self.block_size % 32 and default_block_size("vllm") == 32:
            raise ConfigError(f"--block-size {self.block_size}: vLLM on CPU needs a multiple of 32")
        if self.host_kv_blocks < 0:
            raise ConfigError(f"--host-kv-blocks must be >= 0, got {self.host_kv_blocks}")
        if not self.host_kv_gbps > 0:
            raise ConfigError(f"--host-kv-gbps must be > 0, got {self.host_kv_gbps}")
        if self.engine == "vllm" and self.host_kv_blocks:
            self._check_vllm_host_tier()
        if self.engine == "vllm" and self.answer_tokens:
            raise ConfigError("--answer-tokens is the mocker's: a vLLM model's answers end where the model ends them")
        if self.session_pin_blocks < -1:
            raise ConfigError(f"--session-pin-blocks must be >= 0, or -1 for a quarter of the device's blocks; "
                              f"got {self.session_pin_blocks}")
        if self.engine == "vllm" and self.lora.enabled:
            from services.engines.vllm_lora import vllm_max_lora_rank

            vllm_max_lora_rank(self.lora.max_lora_rank)  # a ConfigError naming the flag past vLLM's largest

    def _check_vllm_host_tier(self) -> None:
        """vLLM's native offloading copies KV between accelerator and host memory: there is
        nothing to offload to where the cache already lives in host memory (vLLM on CPU), and it
        would need a second KV connector beside NIXL, which is not validated."""
        if default_block_size("vllm") == 32:
            raise ConfigError("--host-kv-blocks: vLLM on a CPU-only machine keeps its KV cache in host memory "
                              "already and cannot offload it; use --engine mocker for a host tier here")
        if self.kv_transfer != "none":
            raise ConfigError("--host-kv-blocks: vLLM's host offloading beside NIXL KV transfer is not supported; "
                              "use it on aggregated workers (--prefill-workers 0)")

    @property
    def served_model_name(self) -> str:
        return self.model.served_model_name


def add_engine_flags(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The flags that choose and size the engine; returns their group (the launcher forwards it)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--engine", choices=ENGINES, default="vllm")
    add_model_flags(g)
    g.add_argument("--block-size", type=positive_int, default=None,
                   help="KV block size in tokens (default 16; 32 for vLLM on CPU)")
    g.add_argument("--num-gpu-blocks", type=positive_int, default=DEFAULT_NUM_GPU_BLOCKS,
                   help="mocker: KV blocks per worker")
    g.add_argument("--speedup", type=positive_float, default=1.0,
                   help="mocker: divides the timing model's durations ('inf' = no compute time)")
    g.add_argument("--timing", choices=preset_names(), default=DEFAULT_TIMING,
                   help="mocker: the machine its timing model imitates (a preset profile)")
    g.add_argument("--timing-profile", default=None, metavar="FILE",
                   help="mocker: a worker profile file (python -m services.planner profile) to run as its "
                        "timing, instead of --timing")
    g.add_argument("--max-num-seqs", type=positive_int, default=None, help="running requests per worker")
    g.add_argument("--max-model-len", type=positive_int, default=None,
                   help="the context length served (prompt plus output), in tokens, published with the worker "
                        "and enforced by the processors (default: the model's max_position_embeddings; vLLM "
                        "serves at most that, the mocker any length)")
    g.add_argument("--answer-tokens", type=non_negative_int, default=0, metavar="N",
                   help="mocker: each answer ends with the model's end-of-sequence token after N tokens, as a "
                        "model's answers end (0 = every answer runs to max_tokens); agent clients need answers "
                        "that end")
    g.add_argument("--kv-bytes-per-token", type=positive_int, default=DEFAULT_KV_BYTES_PER_TOKEN,
                   help="mocker: size of the synthetic KV moved per prompt token")
    g.add_argument("--host-kv-blocks", type=non_negative_int, default=0,
                   help="a host-memory KV tier of this many blocks below the device cache: evicted blocks "
                        "move there and are loaded back on a prefix hit (0 = off; vLLM: its CPU offloading)")
    g.add_argument("--host-kv-gbps", type=positive_float, default=DEFAULT_HOST_KV_GBPS,
                   help="mocker: host -> device bandwidth of a load-back, GB/s (its timing, and what the "
                        "router weighs its host hits by)")
    g.add_argument("--session-pin-blocks", type=int, default=DEFAULT_SESSION_PIN_BLOCKS, metavar="N",
                   help="mocker: device KV blocks kept pinned for idle agent sessions between their requests "
                        "(-1 = a quarter of --num-gpu-blocks; 0 = none); past it the least recently active "
                        "sessions' blocks become evictable, kept in the host tier when there is one")
    g.add_argument("--stream-interval-ms", type=non_negative_float, default=DEFAULT_INTERVAL_S * 1000,
                   help="a stream sends at most one message per this many ms; faster tokens ride together "
                        "(0: send each engine output at once)")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters of the model (implied by --lora-modules): at start, and loaded at run "
                        "time through POST /v1/load_lora_adapter")
    g.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) served from the start, each under its NAME as a model")
    g.add_argument("--max-loras", type=positive_int, default=LoraConfig.max_loras,
                   help="adapters kept loaded at once; the least recently used idle one is unloaded for another")
    g.add_argument("--max-lora-rank", type=positive_int, default=LoraConfig.max_lora_rank,
                   help="the highest adapter rank the worker accepts")
    g.add_argument("--min-remote-encode-tokens", type=non_negative_int, default=EncodeConfig.min_tokens,
                   help="with encode workers (E/P/D): images of fewer placeholder tokens are encoded in place")
    g.add_argument("--encoder-cache-dir", default=None, metavar="DIR",
                   help="vLLM with encode workers (E/P/D): the directory encode workers write image features to and "
                        "the workers that prefill read them from (one host, or a filesystem they share)")
    g.add_argument("--encode-timeout", type=positive_float, default=EncodeConfig.timeout_s,
                   help="with encode workers: seconds for one image's encoding and pull before it is encoded in place")
    return g


def add_kv_transfer_flag(parser: argparse.ArgumentParser, default: str = "none") -> None:
    """Workers only: the launcher decides KV transfer from the number of prefill workers."""
    parser.add_argument("--kv-transfer", choices=KV_TRANSFERS, default=default,
                        help="nixl: this worker exchanges KV caches with prefill/decode peers over NIXL")


def default_block_size(engine: str) -> int:
    if engine == "vllm":
        from services.engines.vllm_engine import on_cpu

        return 32 if on_cpu() else 16
    return 16


def engine_config(args: argparse.Namespace, advertise_host: str = "127.0.0.1") -> EngineConfig:
    model = model_ref(args)
    return validated(lambda: EngineConfig(
        engine=args.engine,
        model=model,
        block_size=args.block_size or default_block_size(args.engine),
        num_gpu_blocks=args.num_gpu_blocks,
        speedup=args.speedup,
        timing=args.timing,
        timing_profile=args.timing_profile,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        kv_bytes_per_token=args.kv_bytes_per_token,
        answer_tokens=args.answer_tokens,
        kv_transfer=getattr(args, "kv_transfer", "none"),
        advertise_host=advertise_host,
        host_kv_blocks=args.host_kv_blocks,
        host_kv_gbps=args.host_kv_gbps,
        lora=lora_config(args),
        session_pin_blocks=args.session_pin_blocks,
        encoder_cache_dir=args.encoder_cache_dir,
    ))


def lora_config(args: argparse.Namespace) -> LoraConfig:
    modules = tuple(LoraModule.parse(text) for text in args.lora_modules)
    return LoraConfig(enabled=args.enable_lora or bool(modules), modules=modules, max_loras=args.max_loras,
                      max_lora_rank=args.max_lora_rank)
