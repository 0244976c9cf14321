"""The two generation endpoints, and how one of their requests becomes processor calls."""

from __future__ import annotations

from dataclasses import dataclass

from gen.kvmesh.v1 import common_pb2, processor_pb2
from services.frontend.schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest

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


def processor_requests(rid: str, req: GenerationRequest, explain: bool = False) -> list[processor_pb2.GenerateRequest]:
    """One GenerateRequest per prompt (chat: one); each numbers its choices after the previous ones.
    `explain` asks each processor for the router's reasons (the x-kvmesh-route header)."""
    sampling = _sampling(req)
    if isinstance(req, ChatCompletionRequest):
        msg = _request(rid, req, sampling, 0, explain)
        msg.chat.add_generation_prompt = True
        msg.chat.messages.extend(processor_pb2.ChatMessage(role=m.role, content=m.text(), name=m.name or "")
                                 for m in req.messages)
        return [msg]
    assert isinstance(req, CompletionRequest)
    out = []
    for i, prompt in enumerate(req.prompts()):
        # Only the first prompt's routing reaches the headers (as x-kvmesh-worker): only it is explained.
        msg = _request(rid if i == 0 else f"{rid}-p{i}", req, sampling, i * req.n, explain and i == 0)
        if isinstance(prompt, str):
            msg.text = prompt
        else:
            msg.tokens.ids.extend(prompt)
        out.append(msg)
    return out


def _request(rid: str, req: GenerationRequest, sampling: common_pb2.SamplingParams,
             choice_offset: int, explain: bool) -> processor_pb2.GenerateRequest:
    return processor_pb2.GenerateRequest(request_id=rid, model=req.model, sampling=sampling, n=req.n,
                                         stop=req.stop_list(), choice_offset=choice_offset, explain=explain)


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
    return sampling
