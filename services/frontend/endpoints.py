"""The generation endpoints, and how one of their requests becomes processor calls."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from gen.kvmesh.v1 import common_pb2, processor_pb2
from services.contract.json_value import to_json_value
from services.frontend.agent_schemas import Tool, structured_from_format, structured_from_vllm, tool_choice_of
from services.frontend.errors import ApiError
from services.frontend.images import PartKey
from services.frontend.mesh import ModelTarget
from services.frontend.schemas import (
    ChatCompletionRequest,
    ChatMessageIn,
    CompletionRequest,
    GenerationRequest,
    ImagePart,
)

# The smallest positive float32: a smaller top_p would reach the engine as 0 (invalid) though
# it means what this means, "the most likely token only".
_TINY_TOP_P = 1.401298464324817e-45


@dataclass(frozen=True)
class Kind:
    endpoint: str
    schema: type[GenerationRequest]
    object_name: str
    chunk_name: str
    id_prefix: str


CHAT = Kind("chat", ChatCompletionRequest, "chat.completion", "chat.completion.chunk", "chatcmpl-")
COMPLETION = Kind("completions", CompletionRequest, "text_completion", "text_completion", "cmpl-")
# The Responses API: a chat request underneath (responses_api.py translates both ways).
RESPONSES = Kind("responses", ChatCompletionRequest, "response", "response", "resp_")


def processor_requests(rid: str, req: GenerationRequest, target: ModelTarget | None = None, explain: bool = False,
                       qos: common_pb2.Qos | None = None,
                       session: common_pb2.SessionRef | None = None,
                       images: Mapping[PartKey, bytes] | None = None) -> list[processor_pb2.GenerateRequest]:
    """One GenerateRequest per prompt (chat: one); each numbers its choices after the previous ones.
    `target` is what `req.model` names (MeshView.resolve): the processors get its base model and
    its LoRA adapter (None: `req.model` is a base model). `explain` asks each processor for the
    router's reasons (the x-kvmesh-route header); `qos` is what admission weighs (frontend/qos.py);
    `session` the agent session it belongs to (frontend/sessions.py); `images` the bytes of the
    chat's image parts by (message, part) index (images.py)."""
    sampling = _sampling(req)
    target = target or ModelTarget(req.model)
    if isinstance(req, ChatCompletionRequest):
        msg = _request(rid, req, target, sampling, 0, explain, qos, session)
        _chat_input(req, msg.chat, images or {})
        return [msg]
    assert isinstance(req, CompletionRequest)
    out = []
    for i, prompt in enumerate(req.prompts()):
        # Only the first prompt's routing reaches the headers (as x-kvmesh-worker): only it is explained.
        msg = _request(rid if i == 0 else f"{rid}-p{i}", req, target, sampling, i * req.n, explain and i == 0, qos,
                       session)
        if isinstance(prompt, str):
            msg.text = prompt
        else:
            msg.tokens.ids.extend(prompt)
        out.append(msg)
    return out


def _chat_input(req: ChatCompletionRequest, chat: processor_pb2.ChatInput, images: Mapping[PartKey, bytes]) -> None:
    chat.add_generation_prompt = req.add_generation_prompt
    chat.continue_final_message = req.continue_final_message
    chat.messages.extend(_message(m, i, images) for i, m in enumerate(req.messages))
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    if req.tools:
        with _no_lone_surrogate("tools"):
            chat.tools.extend(_tool(t) for t in req.tools)
        chat.tool_choice.CopyFrom(tool_choice_of(req.tool_choice, req.parallel_tool_calls))
    if kwargs:
        with _no_lone_surrogate("chat_template_kwargs"):
            chat.template_kwargs.CopyFrom(to_json_value(kwargs))


@contextmanager
def _no_lone_surrogate(param: str) -> Iterator[None]:
    """No protobuf string carries a lone surrogate (which JSON may escape): one in a tool's
    parameters or a template argument (the only free JSON here; every other string was checked
    by its schema) is refused naming its field, with the message the processor gave one that
    reached the prompt."""
    try:
        yield
    except UnicodeEncodeError:
        raise ApiError(400, "the rendered prompt is not valid Unicode (an unpaired surrogate escape in tools or "
                            "chat_template_kwargs)", param=param, code="invalid_request") from None


def _tool(tool: Tool) -> processor_pb2.Tool:
    f = tool.function
    out = processor_pb2.Tool(name=f.name, description=f.description, strict=f.strict)
    if f.parameters is not None:
        out.parameters.CopyFrom(to_json_value(f.parameters))
    return out


def _message(m: ChatMessageIn, index: int, images: Mapping[PartKey, bytes]) -> processor_pb2.ChatMessage:
    out = processor_pb2.ChatMessage(name=m.name or "", no_content=m.content is None, role=m.role,
                                    tool_call_id=m.tool_call_id or "",
                                    reasoning=m.reasoning_content or m.reasoning or "")
    if m.images():
        # Part by part, so the template sets each image where the client put it.
        assert isinstance(m.content, list)
        out.parts.extend(processor_pb2.ContentPart(image=images[(index, j)]) if isinstance(part, ImagePart)
                         else processor_pb2.ContentPart(text=part.text) for j, part in enumerate(m.content))
    else:
        out.content = m.text()
    out.tool_calls.extend(processor_pb2.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
                          for c in m.tool_calls or ())
    return out


def _request(rid: str, req: GenerationRequest, target: ModelTarget, sampling: common_pb2.SamplingParams,
             choice_offset: int, explain: bool, qos: common_pb2.Qos | None,
             session: common_pb2.SessionRef | None) -> processor_pb2.GenerateRequest:
    return processor_pb2.GenerateRequest(request_id=rid, model=target.base, lora_name=target.lora_name,
                                         sampling=sampling, n=req.n, stop=req.stop_list(), choice_offset=choice_offset,
                                         explain=explain, qos=qos, session=session)


def _sampling(req: GenerationRequest) -> common_pb2.SamplingParams:
    sampling = common_pb2.SamplingParams(ignore_eos=req.ignore_eos, min_tokens=req.min_tokens)
    limit = req.token_limit()
    if limit is not None:
        sampling.max_tokens = limit
    if req.temperature is not None:
        sampling.temperature = req.temperature
    if req.top_p is not None:
        sampling.top_p = max(req.top_p, _TINY_TOP_P)
    if req.top_k is not None:
        sampling.top_k = req.top_k
    if req.seed is not None:
        sampling.seed = req.seed
    k = req.logprobs_k()
    if k is not None:
        sampling.logprobs = k
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        value = getattr(req, name)
        if value is not None:
            setattr(sampling, name, value)
    for token, bias in (req.logit_bias or {}).items():
        sampling.logit_bias[int(token)] = bias
    sampling.stop_token_ids.extend(req.stop_token_ids or ())
    sampling.bad_words.extend(req.bad_words or ())
    structured = (structured_from_vllm(req.structured_outputs) if req.structured_outputs is not None
                  else structured_from_format(req.response_format) if req.response_format is not None else None)
    if structured is not None:
        sampling.structured.CopyFrom(structured)
    return sampling
