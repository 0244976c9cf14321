"""Writes the demo vision-language model: a tiny random-weight Idefics3 (SmolVLM's architecture).

Like the demo model (make_demo_model.py, whose tokenizer and chat turns it shares, plus the
image tokens), it is useless as a model and real in every other way: a Hugging Face directory
with config, weights, tokenizer, chat template and image processor, that vLLM serves on CPU and
the mocker simulates (its encoder by the config's patches). Idefics3, because its processor
needs no torchvision (CPU hosts have none that matches their torch) and vLLM serves it on CPU.
Each image becomes 16 image tokens between two markers (a 112-pixel square in 14-pixel patches,
merged 2x2), at any input size.

    python -m services.tools.make_demo_vlm --out DIR
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from services.tools.make_demo_model import DemoModelSpec, build_tokenizer

DEFAULT_DIR = Path(".cache/models/kvmesh-demo-vlm")
IMAGE_SIZE = 112
PATCH_SIZE = 14
SCALE_FACTOR = 2
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>"]
# The demo model's ChatML turns, with `{"type": "image"}` parts rendered as the image token.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_demo_vlm(out: Path, image_size: int = IMAGE_SIZE) -> Path:
    """Builds the model into a temp dir and renames it into place (a crash leaves no half model).
    `image_size`: the square side images are resized to (the multimodal benchmark takes 448: 256
    image tokens an image, a real model's order of magnitude)."""
    import torch
    from transformers import (
        GenerationConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaConfig,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    spec = DemoModelSpec(max_context=8192)
    tokenizer = build_tokenizer(spec)
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
                       intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
                       num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                       max_position_embeddings=spec.max_context, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       tie_word_embeddings=False)
    vision = Idefics3VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=image_size, patch_size=PATCH_SIZE)
    config = Idefics3Config(vision_config=vision.to_dict(), text_config=text.to_dict(),
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), scale_factor=SCALE_FACTOR,
                            tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(spec.seed)
    model = Idefics3ForConditionalGeneration(config)  # float32, the default
    with torch.no_grad():
        # Wider random weights than the default init, so the output visibly depends on the image.
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0, 0.2)
    images = Idefics3ImageProcessorPil(do_resize=True, size={"longest_edge": image_size},
                                       max_image_size={"longest_edge": image_size}, do_image_splitting=False,
                                       do_pad=True)
    per_image = (image_size // PATCH_SIZE) ** 2 // SCALE_FACTOR ** 2
    processor = Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=per_image,
                                  chat_template=CHAT_TEMPLATE)
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        staging = Path(tmp) / "model"
        model.save_pretrained(staging, safe_serialization=True)
        processor.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id).save_pretrained(staging)
        if out.exists():
            os.rename(out, Path(tmp) / "replaced")  # removed with the temp dir
        os.rename(staging, out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR)
    print(write_demo_vlm(parser.parse_args().out))


if __name__ == "__main__":
    main()
