"""Writes the demo model: a tiny random-weight Llama and a byte-level BPE tokenizer.

The model is useless as a language model but exercises the real loading path of every engine
and tokenizer, in Hugging Face layout, so any real model directory can replace it.

    python -m services.tools.make_demo_model --out DIR

The directory records the spec it was built from (`kvmesh_demo.json`); `ensure_demo_model` builds
it again when that is not the spec asked for (a new default context length, say), so `make
install` and the launcher never serve a demo model built to an older spec.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

CORPUS = Path(__file__).with_name("corpus.txt")
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
# ChatML turns; tools (when a request has them) in a system turn first, and an assistant's tool
# calls written as <tool_call>{"name": ..., "arguments": {...}}</tool_call>: the format vLLM's
# `hermes` tool-call parser reads.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|im_start|>system\nYou may call these tools. To call one, write <tool_call>{\"name\": <name>, "
    "\"arguments\": <arguments object>}</tool_call>.\n<tools>\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}"
    "{{ '</tools><|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}"
    "{{ '<tool_call>' }}{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "{{ '</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DEFAULT_DIR = Path(".cache/models/kvmesh-demo")
# The spec a demo model directory was built from.
SPEC_FILE = "kvmesh_demo.json"


@dataclass(frozen=True)
class DemoModelSpec:
    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    # Agents send 20-35k tokens of system prompt and tools (of a real model's tokenizer, ~4
    # characters each) before the first user word. This tokenizer's vocabulary (trained on
    # corpus.txt) is small: ~120,000 characters take 60k tokens as English, 76k as Python, 93k as
    # JSON tool schemas. 131072 holds such a start with room for a long session; vLLM on CPU
    # serves it at the same start cost as 4096 (docs/reference.md, "Engines").
    max_context: int = 131072
    seed: int = 0


def build_tokenizer(spec: DemoModelSpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(CORPUS)], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|im_end|>",
        pad_token="<|end_of_text|>",
        model_max_length=spec.max_context,
        chat_template=CHAT_TEMPLATE,
    )


def write_demo_model(out: Path, spec: DemoModelSpec = DemoModelSpec(), replace: bool = False) -> Path:
    """Builds the model into a temp dir and renames it into place, so a crash leaves no half model.
    A model already at `out` is kept (another process finished first), or with `replace` moved
    aside and removed once the new one is in place."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_context,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        staging = Path(tmp) / "model"
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        GenerationConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
        ).save_pretrained(staging)
        (staging / SPEC_FILE).write_text(json.dumps(asdict(spec), indent=1))
        if replace and out.exists():
            os.rename(out, Path(tmp) / "replaced")  # removed with the temp dir
        try:
            os.rename(staging, out)
        except OSError:
            # Another process (a sibling service started at the same time) finished first.
            if not (out / "config.json").exists():
                raise
    return out


def ensure_demo_model(path: Path = DEFAULT_DIR, spec: DemoModelSpec = DemoModelSpec()) -> Path:
    """Returns the demo model directory, creating it on first use, and again when it was built
    from another spec. Built under a lock file beside it, so processes that start together build
    it once; the others wait and find it built."""
    if built_spec(path) == asdict(spec):
        _refresh_template(path)
        return path.resolve()
    with _building(path):
        built = built_spec(path)
        if built == asdict(spec):
            return path.resolve()
        if (path / "config.json").exists():
            changed = ", ".join(f"{k} {(built or {}).get(k)} -> {v}" for k, v in asdict(spec).items()
                                if (built or {}).get(k) != v)
            print(f"rebuilding the demo model in {path} ({changed}) ...", file=sys.stderr, flush=True)
        else:
            print(f"creating the demo model in {path} (first run only) ...", file=sys.stderr, flush=True)
        return write_demo_model(path, spec, replace=True)


def built_spec(path: Path) -> dict[str, object] | None:
    """The spec the model at `path` was built from; None when there is no model there, or one that
    does not say."""
    try:
        if (path / "config.json").exists():
            return json.loads((path / SPEC_FILE).read_text())
    except (OSError, ValueError):
        pass
    return None


@contextmanager
def _building(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _refresh_template(path: Path) -> None:
    """A demo model made by an older version gets the current chat template (the weights and
    vocabulary are unchanged): replaced atomically, so a process reading it meanwhile sees the
    old or the new one, never half."""
    template = path / "chat_template.jinja"
    if template.exists() and template.read_text() == CHAT_TEMPLATE:
        return
    staging = template.with_name(f".{template.name}.{os.getpid()}")
    staging.write_text(CHAT_TEMPLATE)
    os.replace(staging, template)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--max-context", type=int, default=DemoModelSpec.max_context, help="context length in tokens")
    args = parser.parse_args()
    # Nothing to do where the model was built from this spec; built again where from another.
    print(ensure_demo_model(args.out, DemoModelSpec(max_context=args.max_context)))


if __name__ == "__main__":
    main()
