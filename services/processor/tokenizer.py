"""The model's tokenizer and chat template, loaded from its directory."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class PromptError(ValueError):
    """The prompt cannot be turned into tokens (bad template input, ids out of the vocabulary)."""


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: str
    name: str = ""


class ModelTokenizer:
    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer

        self._hf = AutoTokenizer.from_pretrained(model_dir)
        # The Rust tokenizer decodes without Python overhead: it is on the per-token path.
        self._fast: Any = getattr(self._hf, "_tokenizer", None) or self._hf.backend_tokenizer
        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.max_model_len = int(config.get("max_position_embeddings", 4096))
        self.vocab_size = max(int(config.get("vocab_size", 0)), len(self._hf))
        eos = config.get("eos_token_id")
        ids = eos if isinstance(eos, list) else [eos]
        if self._hf.eos_token_id is not None:
            ids.append(self._hf.eos_token_id)
        self.eos_token_ids = tuple(sorted({i for i in ids if i is not None}))

    def encode_chat(self, turns: list[ChatTurn], add_generation_prompt: bool = True) -> list[int]:
        messages = [{"role": t.role, "content": t.content, **({"name": t.name} if t.name else {})} for t in turns]
        try:
            text = self._hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        except Exception as exc:
            raise PromptError(f"chat template rejected the messages: {exc}") from exc
        # The template already wrote BOS and the role markers.
        return self._fast.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        return self._fast.encode(text, add_special_tokens=True).ids

    def check_ids(self, ids: list[int]) -> None:
        bad = next((i for i in ids if i < 0 or i >= self.vocab_size), None)
        if bad is not None:
            raise PromptError(f"token id {bad} is outside the vocabulary (size {self.vocab_size})")

    def decode(self, ids: list[int]) -> str:
        return self._fast.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self._fast.decode([token_id], skip_special_tokens=False)
