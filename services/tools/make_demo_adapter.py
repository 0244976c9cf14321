"""Writes the demo LoRA adapters: random-weight, rank-8 adapters of the demo model in PEFT's format.

Like the demo model they are useless as fine-tunes but exercise the real path: an
`adapter_config.json` and an `adapter_model.safetensors` that vLLM (or PEFT) loads as any
adapter. Each is deterministic from its seed, and its weights are large enough that its greedy
output differs from the base model's and from the other adapter's.

    python -m services.tools.make_demo_adapter            # the demo model and both adapters
    python -m services.tools.make_demo_adapter --out DIR --seed 7 --model MODEL_DIR

`write_stand_in_adapter` writes the other kind the tests and benchmarks use: the same files with no
weights in them (a sparse weights file of a chosen size), all the mocker reads of an adapter.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from services.tools.make_demo_model import DEFAULT_DIR as DEMO_MODEL_DIR
from services.tools.make_demo_model import ensure_demo_model

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Every linear layer of a Llama block: each adapter moves the whole network, not one projection.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class DemoAdapter:
    """One demo adapter: its served name, its seed, and where it lives beside the demo model."""

    name: str
    seed: int

    def path(self, model_dir: Path = DEMO_MODEL_DIR) -> Path:
        return model_dir.parent / f"{model_dir.name}-{self.name.removeprefix('demo-')}"

    def module(self, model_dir: Path = DEMO_MODEL_DIR) -> str:
        """Its `--lora-modules` entry: NAME=PATH."""
        return f"{self.name}={self.path(model_dir).resolve()}"


# `make run` serves these with the demo model (.cache/models/kvmesh-demo-lora-a, -lora-b).
DEMO_ADAPTERS = (DemoAdapter("demo-lora-a", 1), DemoAdapter("demo-lora-b", 2))


@dataclass(frozen=True)
class AdapterSpec:
    rank: int = 8
    lora_alpha: int = 16
    # The standard deviation of B's entries (PEFT initialises B to zero, which would make the
    # adapter a no-op): with A's 1/sqrt(fan_in), each projection moves by about its own size.
    b_std: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rank < 1 or self.lora_alpha < 1 or not self.b_std > 0:
            raise ValueError(f"AdapterSpec: rank and lora_alpha must be >= 1 and b_std > 0, got {self}")


def _shapes(model_dir: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """The model's layer count and each target module's (in, out) features, from config.json."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv = int(config.get("num_key_value_heads") or heads) * head_dim
    inter = int(config["intermediate_size"])
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    return int(config["num_hidden_layers"]), shapes


def _weights(model_dir: Path, spec: AdapterSpec) -> dict:
    import torch

    layers, shapes = _shapes(model_dir)
    gen = torch.Generator().manual_seed(spec.seed)
    tensors = {}
    for layer in range(layers):
        for module in TARGET_MODULES:
            fan_in, fan_out = shapes[module]
            group = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(spec.rank, fan_in, generator=gen) / fan_in ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, spec.rank, generator=gen) * spec.b_std
    return tensors


def _config(rank: int, lora_alpha: int, base_model: str) -> str:
    """An adapter's adapter_config.json, as PEFT writes it."""
    return json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": lora_alpha, "lora_dropout": 0.0, "bias": "none",
        "target_modules": list(TARGET_MODULES), "fan_in_fan_out": False, "inference_mode": True,
        "modules_to_save": None, "use_rslora": False, "use_dora": False,
    }, indent=1)


def write_demo_adapter(out: Path, model_dir: Path, spec: AdapterSpec = AdapterSpec()) -> Path:
    """Builds the adapter into a temp dir and renames it into place, so a crash leaves no half adapter."""
    from safetensors.torch import save_file

    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        staging = Path(tmp) / "adapter"
        staging.mkdir()
        save_file(_weights(model_dir, spec), str(staging / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (staging / ADAPTER_CONFIG).write_text(_config(spec.rank, spec.lora_alpha, model_dir.name))
        try:
            os.rename(staging, out)
        except OSError:
            # Another process (a sibling worker started at the same time) finished first.
            if not (out / ADAPTER_CONFIG).exists():
                raise
    return out


def write_stand_in_adapter(out: Path, size_bytes: int = 4096, rank: int = 8,
                           base_model: str = DEMO_MODEL_DIR.name) -> Path:
    """An adapter in PEFT's layout with no weights in it: its config (rank `rank`, alpha twice
    that, every linear layer) and a sparse weights file of `size_bytes` (no disk blocks). The
    mocker reads no more of an adapter (the rank, and the size its load time comes from); vLLM
    cannot load it. Written into `out` (created, or kept and rewritten: idempotent)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / ADAPTER_CONFIG).write_text(_config(rank, 2 * rank, base_model))
    with (out / ADAPTER_WEIGHTS).open("ab") as f:
        f.truncate(size_bytes)
    return out


def ensure_demo_adapters(model_dir: Path = DEMO_MODEL_DIR) -> list[str]:
    """The demo model and its demo adapters, created on first use; returns the adapters'
    `--lora-modules` entries (NAME=PATH)."""
    ensure_demo_model(model_dir)
    for adapter in DEMO_ADAPTERS:
        path = adapter.path(model_dir)
        if not (path / ADAPTER_CONFIG).exists():
            print(f"creating the demo LoRA adapter {adapter.name} in {path} (first run only) ...",
                  file=sys.stderr, flush=True)
            write_demo_adapter(path, model_dir, AdapterSpec(seed=adapter.seed))
    return [adapter.module(model_dir) for adapter in DEMO_ADAPTERS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="write one adapter here (default: the demo adapters beside the demo model)")
    parser.add_argument("--model", type=Path, default=DEMO_MODEL_DIR, help="the base model directory")
    parser.add_argument("--seed", type=int, default=AdapterSpec.seed)
    parser.add_argument("--rank", type=int, default=AdapterSpec.rank)
    args = parser.parse_args()
    if args.out is None:
        print("\n".join(ensure_demo_adapters(args.model)))
        return
    if (args.out / ADAPTER_CONFIG).exists():
        print(f"{args.out} already holds an adapter; nothing to do", file=sys.stderr)
        return
    print(write_demo_adapter(args.out, args.model, AdapterSpec(rank=args.rank, seed=args.seed)))


if __name__ == "__main__":
    main()
