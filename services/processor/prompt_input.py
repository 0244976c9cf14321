"""A request's prompt as tokens and images: a chat rendered by the model's template (its images
widened), a text encoded, or ids checked against the vocabulary."""

from __future__ import annotations

import asyncio

from gen.kvmesh.v1 import common_pb2, processor_pb2
from services.processor.chat_render import chat_prompt
from services.processor.prompt_errors import PromptError
from services.processor.tokenizer import LARGE_TEXT_CHARS, ModelTokenizer

# Chats with more messages than this render their template in a worker thread.
LARGE_CHAT_MESSAGES = 64


async def tokenized(tok: ModelTokenizer, request: processor_pb2.GenerateRequest
                    ) -> tuple[list[int], list[common_pb2.MediaItem]]:
    """The prompt's tokens and images; a large one (or one with images, which are opened) is
    tokenized in a worker thread so the event loop keeps serving every other stream meanwhile."""
    if _is_large(request):
        return await asyncio.to_thread(tokenize_now, tok, request)
    return tokenize_now(tok, request)


def tokenize_now(tok: ModelTokenizer, request: processor_pb2.GenerateRequest
                 ) -> tuple[list[int], list[common_pb2.MediaItem]]:
    kind = request.WhichOneof("input")
    media: list[common_pb2.MediaItem] = []
    if kind == "chat":
        tokens, media = tok.encode_chat_media(chat_prompt(request.chat, tok.images.holds if tok.images else None))
    elif kind == "text":
        tokens = tok.encode_text(request.text)
    elif kind == "tokens":
        tokens = list(request.tokens.ids)
        tok.check_ids(tokens)
    else:
        raise PromptError("the request has no prompt")
    if not tokens:
        raise PromptError("the prompt is empty")
    return tokens, media


def _is_large(request: processor_pb2.GenerateRequest) -> bool:
    kind = request.WhichOneof("input")
    if kind == "text":
        return len(request.text) > LARGE_TEXT_CHARS
    if kind == "chat":
        messages = request.chat.messages
        # A message with parts may hold images: opened and checked off the event loop.
        return (len(messages) > LARGE_CHAT_MESSAGES or any(m.parts for m in messages)
                or sum(len(m.content) for m in messages) > LARGE_TEXT_CHARS)
    return False
