"""What a GenerateRequest may carry, checked before any tokenizing so a bad call costs nothing.

The gateway checks the same limits on the HTTP side (both take them from
`services/contract/request_limits.py`); these checks are for every other caller of the internal RPC.
A violation is a `PromptError` (the processor answers OUTCOME_BAD_REQUEST) or, for a prompt that
can never fit the model, a `ContextLengthError` (OUTCOME_CONTEXT_TOO_LONG); the message is one line.
"""

from __future__ import annotations

import math

from gen.kvmesh.v1 import common_pb2, processor_pb2
from services.contract.request_limits import INT64_MAX, MAX_LOGPROBS, MAX_N, MAX_STOP_CHARS, MAX_STOP_STRINGS, UINT32_MAX
from services.processor.prompt_errors import ContextLengthError, PromptError

# No token of a real vocabulary spans more characters than this in practice: a text longer than
# this many times the context can never fit it, so it is refused before the tokenizer runs.
CHARS_PER_TOKEN_BOUND = 32


def context_error(prompt_tokens: int, context: int) -> ContextLengthError:
    return ContextLengthError(f"the prompt has {prompt_tokens} tokens; this model's context length is {context} tokens")


def check_request(request: processor_pb2.GenerateRequest, context: int) -> None:
    """Raises PromptError for a request no tokenizing or generating could serve."""
    if not request.model:
        raise PromptError("model is empty")
    if not 1 <= request.n <= MAX_N:
        raise PromptError(f"n must be between 1 and {MAX_N}, got {request.n}")
    # Choice indexes are uint32 on the wire.
    if request.choice_offset + request.n - 1 > UINT32_MAX:
        raise PromptError(f"choice_offset {request.choice_offset} plus n {request.n} overflows the choice index")
    check_stops(list(request.stop))
    check_sampling(request.sampling, request.n)
    check_prompt_size(request, context)
    check_resume(request)


def check_resume(request: processor_pb2.GenerateRequest) -> None:
    """A takeover names each unfinished choice once, within the request's choices, with no
    more tokens than the choice may have."""
    first, n = request.choice_offset, request.n
    seen: set[int] = set()
    for resumed in request.resume:
        if not first <= resumed.index < first + n or resumed.index in seen:
            raise PromptError(f"resume names choice {resumed.index} twice or outside this request's choices "
                              f"{first}..{first + n - 1}")
        seen.add(resumed.index)
        if request.sampling.max_tokens and len(resumed.token_ids) > request.sampling.max_tokens:
            raise PromptError(f"resume of choice {resumed.index} has more tokens than max_tokens")


def check_stops(stops: list[str]) -> None:
    """Each stop string is searched in every delta: their count and length bound that work."""
    if len(stops) > MAX_STOP_STRINGS:
        raise PromptError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise PromptError(f"a stop string may have at most {MAX_STOP_CHARS} characters")


def check_sampling(sampling: common_pb2.SamplingParams, n: int) -> None:
    """Values an engine cannot sample with (NaN, a negative temperature, a seed that overflows)."""
    if sampling.HasField("temperature") and not (math.isfinite(sampling.temperature) and sampling.temperature >= 0):
        raise PromptError(f"temperature must be a finite number >= 0, got {sampling.temperature}")
    if sampling.HasField("top_p") and not (math.isfinite(sampling.top_p) and 0 < sampling.top_p <= 1):
        raise PromptError(f"top_p must be in (0, 1], got {sampling.top_p}")
    if sampling.HasField("top_k") and sampling.top_k < -1:
        raise PromptError(f"top_k must be -1 (off) or >= 0, got {sampling.top_k}")
    if sampling.HasField("logprobs") and sampling.logprobs > MAX_LOGPROBS:
        raise PromptError(f"logprobs must be at most {MAX_LOGPROBS}, got {sampling.logprobs}")
    # Choice i samples with seed + i (an int64 on the wire).
    if sampling.HasField("seed") and sampling.seed + n - 1 > INT64_MAX:
        raise PromptError(f"seed {sampling.seed} plus n {n} overflows a 64-bit seed")


def check_prompt_size(request: processor_pb2.GenerateRequest, context: int) -> None:
    """A prompt that can never fit the context is refused before tokenizing (CONTEXT_TOO_LONG)."""
    kind = request.WhichOneof("input")
    limit = CHARS_PER_TOKEN_BOUND * context
    if kind == "tokens" and len(request.tokens.ids) >= context:
        raise context_error(len(request.tokens.ids), context)
    if kind == "text" and len(request.text) > limit:
        raise _too_many_chars(len(request.text), limit, context)
    if kind == "chat":
        messages = request.chat.messages
        # Every rendered message costs at least one token.
        if len(messages) > context:
            raise ContextLengthError(f"{len(messages)} messages cannot fit this model's context of {context} tokens")
        chars = sum(len(m.content) + len(m.name) + len(m.role) + sum(len(p.text) for p in m.parts)
                    for m in messages)
        if chars > limit:
            raise _too_many_chars(chars, limit, context)


def _too_many_chars(chars: int, limit: int, context: int) -> ContextLengthError:
    return ContextLengthError(f"the prompt has {chars} characters; no prompt over {limit} characters fits this "
                              f"model's context length of {context} tokens")
