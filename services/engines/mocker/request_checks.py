"""What the mocker refuses before a request takes anything: images for a text model, sampling
fields a hash cannot honour, a prompt past the context, a request that could never fit its KV
cache, an unknown LoRA adapter, a KV pull of another adapter or of other tokens."""

from __future__ import annotations

from collections.abc import Callable

from services.engines.base import EngineInfo, EngineRequest, UnsupportedFieldError
from services.engines.lora import AdapterSet
from services.engines.mocker.config import MockerConfig
from services.engines.mocker.encoder import ImageEncoder
from services.engines.mocker.kv_transfer import check_pull_adapter, check_pull_tokens


def check_request(request: EngineRequest, info: EngineInfo, config: MockerConfig, encoder: ImageEncoder,
                  adapters: Callable[[], AdapterSet]) -> None:
    """Raises the refusal (`adapters`: the engine's adapter set, or its own refusal when LoRA is off)."""
    encoder.check(request.media)
    shaping = request.sampling.shaping_fields()
    if shaping:
        # Its tokens are a hash of prompt and position, not a draw from a distribution: a
        # penalty, bias or grammar has nothing to act on, and ignoring it would be a silent
        # wrong answer.
        raise UnsupportedFieldError(shaping[0], f"the mocker engine cannot honour {shaping[0]} (its tokens are "
                                                f"not sampled from a distribution); serve this with vLLM")
    if len(request.token_ids) > info.max_model_len:
        # vLLM's own refusal, so a worker of either engine refuses the same prompts.
        raise ValueError(f"the prompt ({len(request.token_ids)} tokens) is longer than the maximum model length "
                         f"of {info.max_model_len}")
    # The most it can hold at once: its prompt and the longest answer it may get (with
    # --answer-tokens, an agent's max_tokens of 32,000 is not what it will write).
    output = request.sampling.max_tokens
    if config.answer_tokens and not request.sampling.ignore_eos:
        output = min(output, max(config.answer_tokens, request.sampling.min_tokens))
    max_blocks = -(-(len(request.token_ids) + output) // config.block_size)
    if max_blocks > config.num_gpu_blocks:
        raise ValueError(f"request needs {max_blocks} KV blocks; this worker has {config.num_gpu_blocks}")
    if request.lora_name:
        adapters().get(request.lora_name)  # unknown: refused now, not after a wait
    if request.kv_pull is not None:
        check_pull_adapter(request.kv_pull, request.lora_name)
        check_pull_tokens(request.kv_pull, request.token_ids)
