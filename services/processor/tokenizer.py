"""The model's tokenizer and chat template, loaded from its directory."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from services.engines.model_facts import read_model_facts
from gen.kvmesh.v1 import common_pb2
from services.processor.images import ImagePlaceholders
from services.processor.byte_table import build_byte_table
from services.processor.detokenizer import ByteTableDetokenizer, Detokenizer, StreamDetokenizer
from services.processor.prompt_errors import PromptError

if TYPE_CHECKING:
    from services.processor.chat_render import ChatPrompt

# Texts longer than this are encoded with the Rust tokenizer's batch call, which releases the
# GIL (its single-text `encode` holds it: 0.5M characters stall every other thread ~170 ms).
LARGE_TEXT_CHARS = 16_384


class ModelTokenizer:
    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer

        self._hf = AutoTokenizer.from_pretrained(model_dir)
        # The Hugging Face tokenizer, for vLLM's output parsers.
        self.hf: Any = self._hf
        # The Rust tokenizer: prompts are encoded with it, and the detokenizer lanes read its vocabulary and decoder.
        self._fast: Any = getattr(self._hf, "_tokenizer", None) or self._hf.backend_tokenizer
        facts = read_model_facts(model_dir)
        self.facts = facts
        # The model's own context length: what the processor enforces only while no decode worker
        # publishes the one it serves (context_limit.py).
        self.config_context = facts.context_length
        self.vocab_size = max(facts.vocab_size, len(self._hf))
        ids = set(facts.eos_token_ids)
        if self._hf.eos_token_id is not None:
            ids.add(self._hf.eos_token_id)
        self.eos_token_ids = tuple(sorted(ids))
        # A vision-language model's image placeholders (None: the model takes text only).
        self.images = ImagePlaceholders(model_dir, facts.vision) if facts.vision is not None else None
        # Byte-level BPE streams with a table look-up per token; any other tokenizer through
        # DecodeStream (detokenizer.py).
        self._byte_table = build_byte_table(self._fast, self.vocab_size)

    @property
    def detokenizer_lane(self) -> str:
        return "byte table" if self._byte_table is not None else "DecodeStream"

    def detokenizer(self, prompt: Sequence[int]) -> Detokenizer:
        """A stream's detokenizer; `prompt`: the ids before its first token."""
        if self._byte_table is not None:
            return ByteTableDetokenizer(self._byte_table)
        return StreamDetokenizer(self._fast, prompt)

    def encode_chat(self, prompt: ChatPrompt) -> list[int]:
        """The prompt's ids (a prompt with images: `encode_chat_media`)."""
        ids, media = self.encode_chat_media(prompt)
        return ids

    def encode_chat_media(self, prompt: ChatPrompt) -> tuple[list[int], list[common_pb2.MediaItem]]:
        """The prompt's ids, each image's placeholders widened (images.py), and its images."""
        if prompt.images and self.images is None:
            raise PromptError("this model takes text only: images are served by vision-language models",
                              param="messages")
        ids = self._render(prompt)
        if not prompt.images:
            return ids, []
        assert self.images is not None
        return self.images.expand(ids, prompt.images)

    def _render(self, prompt: ChatPrompt) -> list[int]:
        try:
            text = self._hf.apply_chat_template(prompt.messages, tools=prompt.tools, tokenize=False,  # type: ignore[arg-type]
                                                add_generation_prompt=prompt.add_generation_prompt,
                                                continue_final_message=prompt.continue_final_message,
                                                **prompt.kwargs)
        except Exception as exc:
            # One line: a template error can quote the template across several.
            reason = " ".join(str(exc).split())[:300]
            raise PromptError(f"chat template rejected the messages: {reason}", param="messages") from exc
        if not isinstance(text, str):
            raise PromptError("the chat template did not render text", param="messages")
        # The template already wrote BOS and the role markers.
        try:
            return self._encode(text, add_special_tokens=False)
        except (UnicodeEncodeError, TypeError):
            # The Rust tokenizer takes no lone surrogate (TypeError): one escaped in a tool
            # schema or a template argument reached the text.
            raise PromptError("the rendered prompt is not valid Unicode (an unpaired surrogate escape in tools or "
                              "chat_template_kwargs)", param="tools") from None

    def encode_text(self, text: str) -> list[int]:
        return self._encode(text, add_special_tokens=True)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) > LARGE_TEXT_CHARS:
            return self._fast.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._fast.encode(text, add_special_tokens=add_special_tokens).ids

    def check_ids(self, ids: list[int]) -> None:
        """Every id must name a vocabulary entry: an engine indexes its embedding table with it."""
        if not ids or (min(ids) >= 0 and max(ids) < self.vocab_size):  # min/max: C speed on the common path
            return
        bad = next(i for i in ids if i < 0 or i >= self.vocab_size)
        raise PromptError(f"token id {bad} is outside the vocabulary (size {self.vocab_size})")

    def decode(self, ids: list[int]) -> str:
        return self._fast.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self._fast.decode([token_id], skip_special_tokens=False)
