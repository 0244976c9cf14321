"""Model facts come from the model's config class (its text config for a vision-language model);
a directory they cannot be read from is one line naming it and the fact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.engines.model_facts import ModelFactsError, VisionFacts, read_model_facts

DEMO = Path(".cache/models/kvmesh-demo")
DEMO_VLM = Path(".cache/models/kvmesh-demo-vlm")


def test_a_flat_text_model() -> None:
    facts = read_model_facts(str(DEMO))
    config = json.loads((DEMO / "config.json").read_text())
    assert (facts.vocab_size, facts.context_length) == (config["vocab_size"], config["max_position_embeddings"])
    assert config["eos_token_id"] in facts.eos_token_ids and facts.vision is None


def test_a_vision_language_model_nests_its_text_config() -> None:
    config = json.loads((DEMO_VLM / "config.json").read_text())
    assert "vocab_size" not in config  # the case that used to kill the worker with KeyError
    facts = read_model_facts(str(DEMO_VLM))
    assert facts.vocab_size == config["text_config"]["vocab_size"]
    assert facts.context_length == config["text_config"]["max_position_embeddings"]
    assert facts.vision == VisionFacts(config["image_token_id"], 14, 112)
    assert facts.vision.patches(1280, 720) == 64  # resized to a 112-pixel square: 8x8 patches


def test_dynamic_resolution_counts_the_image_s_own_patches() -> None:
    assert VisionFacts(1, 14, 0).patches(1280, 720) == 92 * 52


def test_a_directory_without_a_config_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ModelFactsError, match=f"^model directory {tmp_path}: no config.json"):
        read_model_facts(str(tmp_path))


def test_a_config_without_a_vocabulary_names_the_fact(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 64,
                                                      "vocab_size": None}))
    with pytest.raises(ModelFactsError) as refused:
        read_model_facts(str(tmp_path))
    assert "vocab_size" in str(refused.value) and "\n" not in str(refused.value)


def test_an_unknown_architecture_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model", "text_config": {}}))
    with pytest.raises(ModelFactsError, match="transformers cannot read its config") as refused:
        read_model_facts(str(tmp_path))
    assert "\n" not in str(refused.value)
