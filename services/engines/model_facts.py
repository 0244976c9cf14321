"""What an engine or a processor reads from a Hugging Face model directory before it starts.

The facts come from the model's own config class (transformers' `AutoConfig`, and its text
config: a vision-language model, Gemma 3 or Llama 4 nest the language model's settings under
`text_config`), so every default the class supplies counts as it does for vLLM. One shortcut:
a flat config.json that states every fact at its top level is read as it is (what its config
class would hold), because importing transformers costs a mocker worker ~2 s of start per
process (torch comes with it), and a flat text model is the common case.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.config_error import ConfigError

_FLAT_FACTS = ("vocab_size", "max_position_embeddings")
# Where vision-language config classes keep the id of the token an image's features replace
# (LLaVA: image_token_index; Qwen2-VL, Gemma 3 and most newer ones: image_token_id).
_IMAGE_TOKEN_KEYS = ("image_token_id", "image_token_index")


class ModelFactsError(ConfigError):
    """A model directory the mesh cannot serve: the message names the directory and the fact."""


@dataclass(frozen=True, slots=True)
class VisionFacts:
    """What a vision-language model's config says of its image encoder."""

    image_token_id: int
    # The encoder's patch side in pixels, and the square side it resizes every image to (0: it
    # takes each image at its own size, as Qwen2-VL does).
    patch_size: int
    image_size: int = 0

    def patches(self, width: int, height: int) -> int:
        """The patches an image of this size is encoded as: what an encoder's work grows with."""
        if self.image_size:
            return (self.image_size // self.patch_size) ** 2
        return -(-width // self.patch_size) * -(-height // self.patch_size)


@dataclass(frozen=True, slots=True)
class ModelFacts:
    vocab_size: int
    # The model's own context length (its text config's max_position_embeddings).
    context_length: int
    eos_token_ids: tuple[int, ...]
    # Set for a model that takes images.
    vision: VisionFacts | None = None
    # The language model's width (its text config's hidden_size; 0: not stated): what one
    # token's image features take, at 2 bytes a value.
    hidden_size: int = 0


def read_model_facts(model_dir: str) -> ModelFacts:
    """The facts of the model in `model_dir`; ModelFactsError (one line) when they cannot be read."""
    raw = _config_json(model_dir)
    if "text_config" not in raw and "vision_config" not in raw and all(isinstance(raw.get(k), int) for k in _FLAT_FACTS):
        hidden = raw.get("hidden_size")
        return ModelFacts(int(raw["vocab_size"]), int(raw["max_position_embeddings"]),
                          _eos_ids(raw.get("eos_token_id"), model_dir), None, hidden if isinstance(hidden, int) else 0)
    return _from_config_class(model_dir)


def _config_json(model_dir: str) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelFactsError(f"model directory {model_dir}: no config.json (not a Hugging Face model directory)") \
            from None
    except (OSError, ValueError) as exc:
        raise ModelFactsError(f"model directory {model_dir}: config.json cannot be read: {exc}") from None
    if not isinstance(raw, dict):
        raise ModelFactsError(f"model directory {model_dir}: config.json is not a JSON object")
    return raw


def _from_config_class(model_dir: str) -> ModelFacts:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir)
    except Exception as exc:  # transformers raises ValueError, KeyError, OSError by architecture
        reason = " ".join(str(exc).split())[:300]
        raise ModelFactsError(f"model directory {model_dir}: transformers cannot read its config: {reason}") from None
    text = config.get_text_config()
    vocab = _fact(text, "vocab_size", model_dir)
    context = _fact(text, "max_position_embeddings", model_dir)
    eos = getattr(text, "eos_token_id", None)
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    hidden = getattr(text, "hidden_size", 0)
    return ModelFacts(vocab, context, _eos_ids(eos, model_dir), _vision(config, model_dir),
                      hidden if isinstance(hidden, int) else 0)


def _fact(config: Any, name: str, model_dir: str) -> int:
    value = getattr(config, name, None)
    if not isinstance(value, int) or value <= 0:
        raise ModelFactsError(f"model directory {model_dir}: its config has no {name} (read from "
                              f"{type(config).__name__})")
    return value


def _vision(config: Any, model_dir: str) -> VisionFacts | None:
    vision = getattr(config, "vision_config", None)
    if vision is None:
        return None
    token = next((getattr(config, k) for k in _IMAGE_TOKEN_KEYS if isinstance(getattr(config, k, None), int)), None)
    if token is None:
        raise ModelFactsError(f"model directory {model_dir}: its vision config names no image token "
                              f"({' or '.join(_IMAGE_TOKEN_KEYS)})")
    size = getattr(vision, "image_size", 0)
    return VisionFacts(token, _fact(vision, "patch_size", model_dir), size if isinstance(size, int) else 0)


def _eos_ids(eos: object, model_dir: str) -> tuple[int, ...]:
    """The config's end-of-sequence ids, and those of generation_config.json, which newer models
    (Llama 3's several) state there alone."""
    ids = set(_as_ids(eos))
    generation = Path(model_dir) / "generation_config.json"
    if generation.is_file():
        try:
            ids.update(_as_ids(json.loads(generation.read_text()).get("eos_token_id")))
        except (OSError, ValueError, AttributeError):
            pass  # a broken generation config: the model's own config's ids stand
    return tuple(sorted(ids))


def _as_ids(eos: object) -> list[int]:
    if isinstance(eos, int):
        return [eos]
    if isinstance(eos, list):
        return [i for i in eos if isinstance(i, int)]
    return []
