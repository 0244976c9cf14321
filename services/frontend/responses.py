"""OpenAI response bodies and stream chunks built from the processor's messages."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from gen.kvmesh.v1 import common_pb2, processor_pb2


@dataclass
class ChoiceAccumulator:
    """One choice of a non-streamed response, assembled from its deltas."""

    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    tokens: list[processor_pb2.ChoiceDelta] = field(default_factory=list)


def usage_body(usage: processor_pb2.Usage, hide_cached: bool = False) -> dict:
    """OpenAI's usage object; `hide_cached` leaves out the prefix-cache hit (an optional field)."""
    body: dict = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
    if not hide_cached:
        body["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    return body


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chat_logprobs(deltas: list[processor_pb2.ChoiceDelta]) -> dict:
    content = []
    for d in deltas:
        for lp, text in zip(d.logprobs, d.token_texts):
            content.append({
                "token": text, "logprob": lp.logprob, "bytes": _token_bytes(text),
                "top_logprobs": [{"token": t.text, "logprob": t.logprob, "bytes": _token_bytes(t.text)} for t in lp.top],
            })
    return {"content": content}


def completion_logprobs(deltas: list[processor_pb2.ChoiceDelta], offset: int = 0) -> dict:
    tokens, token_logprobs, top, text_offset = [], [], [], []
    for d in deltas:
        for lp, text in zip(d.logprobs, d.token_texts):
            tokens.append(text)
            token_logprobs.append(lp.logprob)
            top.append({t.text: t.logprob for t in lp.top})
            text_offset.append(offset)
            offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": text_offset}


# One SSE event per chunk on the streaming hot path: msgspec encodes a chunk ~10x faster than
# json.dumps (compact, UTF-8, the same JSON).
_ENCODE = msgspec.json.Encoder().encode


def sse(obj: dict) -> bytes:
    return b"data: " + _ENCODE(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def prefill_header(location: common_pb2.PrefillLocation) -> str:
    """The `x-kvmesh-prefill` header: `remote:<prefill worker id>`, or `local` (also when unset)."""
    if location.site == common_pb2.PrefillLocation.SITE_REMOTE:
        return f"remote:{location.prefill_worker_id}"
    return "local"
