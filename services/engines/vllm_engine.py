"""vLLM v1 (`AsyncLLM`) in-process behind the `Engine` interface; CUDA or CPU build.

vLLM's stat-logger and output types are unstable interfaces: this module is the only place that
touches them, and the pinned version in scripts/install.sh is the one it is tested against.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection
from contextlib import aclosing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from services.engines.base import (
    EncodedImage,
    Engine,
    EngineInfo,
    EngineOutput,
    EngineRequest,
    LoadSnapshot,
    MediaInput,
    PrefillResult,
    RowTap,
    UnsupportedFieldError,
)
from services.engines.lora import LORA_OFF, LoraConfig
from services.engines.model_facts import read_model_facts
from services.engines.vllm_encode import EncoderCacheShare, FeatureWriter
from services.engines.vllm_images import IMAGES_PER_PROMPT, vllm_prompt
from services.engines.vllm_kv_events import VllmKvEventListener
from services.engines.vllm_stats import LoadRecorder
from services.engines.vllm_lora import held_lora, lora_engine_args, preload, vllm_adapters
from services.engines.vllm_moves import VllmMoves
from services.engines.vllm_outputs import finish_reason_of, logprobs_of, param_of, structured_outputs
from services.engines.vllm_row_tap import tap_request
from services.engines.vllm_warmup import WarmUpPlan, warm_up

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VllmConfig:
    model_dir: str
    served_model_name: str
    block_size: int = 32
    max_model_len: int | None = None
    max_num_seqs: int = 64
    # On CPU, the KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE); ignored on GPU.
    cpu_kv_cache_gib: int = 1
    gpu_memory_utilization: float = 0.85
    # vLLM's KVTransferConfig for its KV connector (NIXL between prefill and decode workers).
    kv_connector: dict[str, Any] | None = None
    # vLLM's native CPU offloading, sized to this many KV blocks (0: off; GPU only).
    host_kv_blocks: int = 0
    # Whether vLLM publishes its KV events (the worker's `--kv-events`): off, it has no publisher
    # and the worker no listener.
    kv_events: bool = True
    # Where vLLM publishes its KV events to this worker (a free loopback port the worker chose).
    kv_events_port: int = 0
    # LoRA adapters (--enable-lora, --lora-modules, --max-loras, --max-lora-rank).
    lora: LoraConfig = LORA_OFF
    # The encode stage's shared directory of image features (vllm_encode.py); None: off.
    encoder_cache: EncoderCacheShare | None = None


def kv_bytes_per_token(model_dir: str, dtype_bytes: int = 2) -> int:
    """KV bytes one token occupies across every layer (keys and values), from config.json."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    return 2 * int(config["num_hidden_layers"]) * kv_heads * head_dim * dtype_bytes


def nixl_transfer_config(advertise_host: str, side_channel_port: int) -> dict[str, Any]:
    """vLLM's NixlConnector for both roles. Its side channel needs a port of its own per engine
    (the worker picks it) and a host its peers can reach; vLLM reads both only from the
    environment, so they are set there before the engine starts."""
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = advertise_host
    config: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                              "kv_buffer_device": "cpu" if on_cpu() else "cuda"}
    if on_cpu():
        # NIXL's progress thread spins a core per idle engine; see vllm_nixl.py.
        config["kv_connector_module_path"] = "services.engines.vllm_nixl"
    return config


def on_cpu() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:
        return True


def cpu_kernels() -> str:
    """Which of vLLM's x86 CPU kernel builds this machine loads, as vLLM chooses it from the CPU's
    features: kernels (and bfloat16 numerics) differ between machines, so the log says which ran."""
    import platform

    import torch

    if platform.machine() not in ("x86_64", "AMD64"):
        return f"vllm._C ({platform.machine()})"
    try:  # torch's private probes, the ones vLLM asks: a log line must not fail a start
        if not torch.cpu._is_avx512_supported():
            return "vllm._C_AVX2"
        if not torch.cpu._is_avx512_bf16_supported():
            return "vllm._C_AVX512"
        return "vllm._C (AVX-512 BF16, AMX tiles)" if torch.cpu._is_amx_tile_supported() else "vllm._C (AVX-512 BF16)"
    except AttributeError:
        return "vLLM CPU kernels (unknown build)"


class VllmEngine(Engine):
    name = "vllm"

    def __init__(self, config: VllmConfig) -> None:
        facts = read_model_facts(config.model_dir)
        context = facts.context_length
        # vLLM serves no more than the model's positions (it refuses a longer max_model_len).
        max_len = min(config.max_model_len or context, context)
        if max_len < (config.max_model_len or 0):
            log.warning("--max-model-len %d is past the model's context length (max_position_embeddings %d): "
                        "serving %d tokens", config.max_model_len, context, max_len)
        self.config = config
        self.info = EngineInfo(config.model_dir, config.served_model_name, config.block_size, max_len,
                               facts.vocab_size, facts.eos_token_ids)
        self._llm: Any = None
        self._vision = facts.vision
        share = config.encoder_cache
        self._features = FeatureWriter(share, facts.vision) if share is not None and share.producer else None
        self._load = LoadRecorder(self.record_kv_transfer)
        self._moves = VllmMoves(lambda: kv_bytes_per_token(config.model_dir))
        self._num_blocks = 0
        self._events: VllmKvEventListener | None = None
        self.adapters = vllm_adapters(config.lora, lambda: self._llm)

    async def start(self) -> None:
        from vllm.config import StructuredOutputsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if on_cpu():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.config.cpu_kv_cache_gib))
        kwargs: dict[str, Any] = dict(
            model=self.config.model_dir,
            served_model_name=self.config.served_model_name,
            block_size=self.config.block_size,
            max_model_len=self.info.max_model_len,
            max_num_seqs=self.config.max_num_seqs,
            enable_prefix_caching=True,
            disable_log_stats=False,
            enforce_eager=on_cpu(),
            # JSON output without insignificant whitespace (vLLM sets this per engine, not per
            # request): a model can otherwise pad an object with spaces until max_tokens.
            structured_outputs_config=StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True),
            **lora_engine_args(self.config.lora),
        )
        if not on_cpu():
            kwargs["gpu_memory_utilization"] = self.config.gpu_memory_utilization
        if self._vision is not None:
            kwargs["limit_mm_per_prompt"] = {"image": IMAGES_PER_PROMPT}
        if self.config.encoder_cache is not None:
            from vllm.config import ECTransferConfig

            os.makedirs(self.config.encoder_cache.directory, exist_ok=True)
            kwargs["ec_transfer_config"] = ECTransferConfig(**self.config.encoder_cache.transfer_config())
        if self.config.kv_events:
            from vllm.config import KVEventsConfig

            if not self.config.kv_events_port:
                raise ValueError("VllmConfig.kv_events_port: the worker must give vLLM's KV events a port")
            self._events = VllmKvEventListener(self.config.kv_events_port, self.emit_kv_event)
            self._events.start()
            kwargs["kv_events_config"] = KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=self._events.publisher_endpoint
            )
        if self.config.host_kv_blocks:
            from vllm.config import KVTransferConfig

            nbytes = self.config.host_kv_blocks * self.config.block_size * kv_bytes_per_token(self.config.model_dir)
            kwargs["kv_offloading_size"] = nbytes / (1 << 30)  # GiB, vLLM's unit
            # Offloaded blocks announced with their tokens, so the router can index them (vLLM adds
            # its offloading connector to this config).
            kwargs["kv_transfer_config"] = KVTransferConfig(
                kv_connector_extra_config={"self_describing_kv_events": True})
        elif self.config.kv_connector:
            from vllm.config import KVTransferConfig

            kwargs["kv_transfer_config"] = KVTransferConfig(**self.config.kv_connector)
        args = AsyncEngineArgs(**kwargs)
        self._llm = AsyncLLM.from_engine_args(args, stat_loggers=[self._load.factory()])
        self._num_blocks = int(self._llm.vllm_config.cache_config.num_gpu_blocks or 0)
        if self._features is None:  # an encoder-only engine has no KV to warm
            await self._warm_up()
        await preload(self.adapters)
        log.info("vLLM engine ready: %s, %d KV blocks of %d tokens", self.config.model_dir,
                 self._num_blocks, self.config.block_size)

    async def _warm_up(self) -> None:
        """Makes the first real request safe (see vllm_warmup.py); its requests leave no trace
        in the load the worker reports."""
        llm = self._llm
        plan = WarmUpPlan.for_engine(self.config.block_size, self.info.max_model_len)
        # The host tier (vLLM's offloading connector) may hold copies of the warm-up's blocks too.
        reset = lambda: llm.reset_prefix_cache(reset_connector=bool(self.config.host_kv_blocks))
        seconds = await warm_up(self.generate, reset, plan, self.info.vocab_size)
        self._load.prefix_queries = self._load.prefix_hits = 0
        device = cpu_kernels() if on_cpu() else "GPU"
        log.info("vLLM warm-up: a %d-token prompt, then prompts of %s tokens together, in %.2f s (%s, %s)",
                 plan.long_prompt, " and ".join(map(str, plan.small_prompts)), seconds, device,
                 str(llm.vllm_config.model_config.dtype).removeprefix("torch."))

    async def stop(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        if self._events is not None:
            await self._events.stop()
            self._events = None

    async def check_health(self) -> None:
        if self._llm is None:
            raise RuntimeError("vLLM engine is not started")
        await self._llm.check_health()

    def load(self) -> LoadSnapshot:
        r = self._load
        total = self._num_blocks
        return LoadSnapshot(
            request_active_slots=r.running,
            request_total_slots=self.config.max_num_seqs,
            kv_active_blocks=int(round(r.kv_usage * total)),
            kv_total_blocks=total,
            num_requests_waiting=r.waiting,
            gpu_cache_usage_perc=r.kv_usage,
            gpu_prefix_cache_hit_rate=r.prefix_hits / r.prefix_queries if r.prefix_queries else 0.0,
        )

    def _sampling_params(self, request: EngineRequest, extra_args: dict[str, Any] | None = None) -> Any:
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        s = request.sampling
        kwargs: dict[str, Any] = dict(
            max_tokens=s.max_tokens,
            ignore_eos=s.ignore_eos,
            min_tokens=s.min_tokens,
            stop_token_ids=list(s.stop_token_ids),
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,
        )
        for name in ("temperature", "top_p", "top_k", "seed", "logprobs", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "min_p"):
            value = getattr(s, name)
            if value is not None:
                kwargs[name] = value
        if s.logit_bias:
            kwargs["logit_bias"] = dict(s.logit_bias)
        if s.bad_words:
            kwargs["bad_words"] = list(s.bad_words)
        if s.structured is not None:
            kwargs["structured_outputs"] = structured_outputs(s.structured)
        if extra_args:
            kwargs["extra_args"] = extra_args
        return SamplingParams(**kwargs)

    async def generate(self, request: EngineRequest, tap: RowTap | None = None) -> AsyncGenerator[EngineOutput, None]:
        # `tap`: vLLM's per-step output loop may hand plain outputs to it (vllm_row_tap.py).
        extra = {"kv_transfer_params": request.kv_pull} if request.kv_pull else None
        live = self._moves.track(request, tap)
        try:
            # The adapter stays resident (held) until the request's last output, or its abort.
            async with held_lora(self.adapters, request.lora_name) as lora:
                outputs = self._generate(request, extra, tap=tap, lora=lora, seen=live.generated.extend)
                async with aclosing(outputs):  # closed early: vLLM aborts the request
                    async for output in outputs:
                        live.generated += output.token_ids
                        yield output
                        if output.finish_reason is not None:
                            return
                        if live.moving is not None:
                            break  # handed over (vllm_moves.py): stopped at this output
            if live.moving is not None:
                yield await self._moves.hand_over(live, self.prefill)
        finally:
            self._moves.untrack(live)

    @property
    def can_move(self) -> bool:
        return bool(self.config.kv_connector)

    async def move_out(self, request_ids: Collection[str] | None = None) -> int:
        return await self._moves.move_out(request_ids) if self.can_move else 0

    def moves_unpulled(self) -> int:
        return self._moves.unpulled()

    async def prefill(self, request: EngineRequest) -> PrefillResult:
        """Prompt with one output token; vLLM keeps the KV for the decode engine to pull via NIXL."""
        if not self.config.kv_connector:
            return await super().prefill(request)
        one = replace(request, sampling=replace(request.sampling, max_tokens=1), kv_pull=None)
        cached, params = 0, None
        # The KV is computed with the request's adapter: the decode side pulls it under the same one.
        async with held_lora(self.adapters, request.lora_name) as lora:
            async for out in self._generate(one, {"kv_transfer_params": {"do_remote_decode": True}}, keep_params=True,
                                            lora=lora):
                cached = out.cached_tokens
                params = out.kv_pull or params
        if params is None:
            raise RuntimeError("vLLM returned no KV transfer parameters (is the NixlConnector configured?)")
        return PrefillResult(params, cached)

    # -- the encode stage (vllm_encode.py) ------------------------------------------------------

    def to_encode(self, request: EngineRequest) -> list[MediaInput]:
        share = self.config.encoder_cache
        return share.to_encode(request) if share is not None else []

    async def encode(self, request_id: str, item: MediaInput) -> EncodedImage:
        if self._features is None:
            raise NotImplementedError("this vLLM worker is no encode worker")
        return await self._features.encode(self._llm, request_id, item)

    async def take_features(self, item: MediaInput, features: dict) -> None:
        if self.config.encoder_cache is None:
            raise NotImplementedError("this vLLM worker was started without --encoder-cache-dir")
        self.config.encoder_cache.taken(item, features)

    async def _generate(self, request: EngineRequest, extra_args: dict[str, Any] | None,
                        keep_params: bool = False, tap: RowTap | None = None,
                        lora: Any = None,
                        seen: Callable[[list[int]], object] | None = None) -> AsyncGenerator[EngineOutput, None]:
        """`seen`: hears the tokens the tap delivers past this generator."""
        if self._llm is None:
            raise RuntimeError("vLLM engine is not started")
        from vllm.exceptions import VLLMClientError

        params = self._sampling_params(request, extra_args)
        prompt = await vllm_prompt(request, self._vision)
        # Closing this generator early (client gone) makes AsyncLLM abort the request.
        async with aclosing(self._llm.generate(prompt, params, request.request_id, lora_request=lora)) as stream:
            try:
                first = await anext(stream)
            except VLLMClientError as exc:
                # vLLM refused the request itself (a token out of vocabulary, a schema its grammar
                # backend cannot compile, ...): the Engine interface says ValueError, which
                # workers answer with OUTCOME_BAD_REQUEST, naming the field when vLLM names one.
                raise UnsupportedFieldError(param_of(exc, request.sampling), str(exc)) from exc
            except StopAsyncIteration:
                return
            if tap is not None and not first.finished:
                tap_request(self._llm, request.request_id, tap, seen)
            async for out in _prepend(first, stream):
                completion = out.outputs[0]
                result = EngineOutput(
                    token_ids=list(completion.token_ids),
                    finish_reason=finish_reason_of(completion.finish_reason) if out.finished else None,
                    cached_tokens=int(out.num_cached_tokens or 0),
                    logprobs=logprobs_of(completion) if request.sampling.logprobs is not None else None,
                )
                if keep_params and out.kv_transfer_params:
                    result.kv_pull = dict(out.kv_transfer_params)
                yield result


async def _prepend(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item
