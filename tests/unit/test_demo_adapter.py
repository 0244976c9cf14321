"""The demo LoRA adapters: real PEFT files that fit the demo model, the same bytes from the same
seed, and the launcher's --demo-lora rule that serves them (`make run`); and the stand-in adapters
the tests and benchmarks serve on the mocker: the same layout, a sized weights file, no weights."""

from __future__ import annotations

import json
from pathlib import Path

from services.engines.lora import read_adapter
from services.tools.make_demo_adapter import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, DEMO_ADAPTERS, TARGET_MODULES,
                                              AdapterSpec, write_demo_adapter, write_stand_in_adapter)
from services.tools.make_demo_model import ensure_demo_model


def test_an_adapter_is_a_peft_directory_whose_shapes_fit_the_model(tmp_path: Path) -> None:
    from safetensors import safe_open

    model = ensure_demo_model()
    out = write_demo_adapter(tmp_path / "a", model, AdapterSpec(seed=3))
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert (config["peft_type"], config["r"], config["target_modules"]) == ("LORA", 8, list(TARGET_MODULES))
    model_config = json.loads((model / "config.json").read_text())
    hidden, layers = model_config["hidden_size"], model_config["num_hidden_layers"]
    kv_width = model_config["num_key_value_heads"] * hidden // model_config["num_attention_heads"]
    with safe_open(str(out / ADAPTER_WEIGHTS), "pt") as weights:
        keys = set(weights.keys())
        assert len(keys) == layers * len(TARGET_MODULES) * 2
        prefix = "base_model.model.model.layers.1"
        assert list(weights.get_tensor(f"{prefix}.self_attn.q_proj.lora_A.weight").shape) == [8, hidden]
        assert list(weights.get_tensor(f"{prefix}.self_attn.v_proj.lora_B.weight").shape) == [kv_width, 8]
        assert list(weights.get_tensor(f"{prefix}.mlp.down_proj.lora_A.weight").shape) == [
            8, model_config["intermediate_size"]]
    adapter = read_adapter("a", str(out), max_rank=8, int_id=1)
    assert adapter.rank == 8 and adapter.size_bytes == (out / ADAPTER_WEIGHTS).stat().st_size


def test_the_same_seed_writes_the_same_bytes_and_another_seed_other_ones(tmp_path: Path) -> None:
    model = ensure_demo_model()
    first, again, other = (write_demo_adapter(tmp_path / name, model, AdapterSpec(seed=seed))
                           for name, seed in (("x", 5), ("y", 5), ("z", 6)))
    assert (first / ADAPTER_WEIGHTS).read_bytes() == (again / ADAPTER_WEIGHTS).read_bytes()
    assert (first / ADAPTER_WEIGHTS).read_bytes() != (other / ADAPTER_WEIGHTS).read_bytes()


def test_a_stand_in_adapter_has_the_demo_ones_config_and_a_weights_file_of_its_size(tmp_path: Path) -> None:
    out = write_stand_in_adapter(tmp_path / "s", size_bytes=3_000_000, rank=4)
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    assert config["target_modules"] == list(TARGET_MODULES)
    adapter = read_adapter("s", str(out), max_rank=8, int_id=1)
    assert (adapter.rank, adapter.size_bytes) == (4, 3_000_000)
    assert write_stand_in_adapter(out, size_bytes=3_000_000, rank=4) == out  # again: kept as it is


def test_demo_lora_serves_both_demo_adapters_with_the_demo_model_only() -> None:
    from services.launch.config import load, with_demo_adapters

    def lora_argv(*flags: str) -> list[str]:
        argv = list(with_demo_adapters(load(["--engine", "mocker", *flags])).engine_argv)
        return argv[argv.index("--lora-modules"):] if "--lora-modules" in argv else []

    demo = [a.module() for a in DEMO_ADAPTERS]
    assert [m.split("=")[0] for m in demo] == ["demo-lora-a", "demo-lora-b"]
    assert lora_argv("--demo-lora") == ["--lora-modules", *demo]
    assert all((Path(m.split("=", 1)[1]) / ADAPTER_CONFIG).exists() for m in demo)
    assert lora_argv() == []
    assert lora_argv("--demo-lora", "--model", "/models/other") == []
    # Adapters the user names replace the demo ones, and reach the workers as one flag with its entries.
    assert lora_argv("--demo-lora", "--lora-modules", "x=/a/x", "y=/a/y") == ["--lora-modules", "x=/a/x", "y=/a/y"]
