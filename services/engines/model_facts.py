"""What an engine reads from a Hugging Face model directory before it starts, whatever the engine."""

from __future__ import annotations

import json
from pathlib import Path


def read_model_facts(model_dir: str) -> tuple[int, int, tuple[int, ...]]:
    """(vocab size, context length, eos ids) from a Hugging Face config.json."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return int(config["vocab_size"]), int(config.get("max_position_embeddings", 4096)), eos_ids
