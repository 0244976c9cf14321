"""The mocker engine's configuration: its cache, batch limits, timing and what it imitates."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.engines.lora import LORA_OFF, LoraConfig
from services.engines.mocker.timing import TimingModel


@dataclass(frozen=True)
class MockerConfig:
    model_dir: str
    served_model_name: str
    block_size: int = 16
    num_gpu_blocks: int = 16384
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # The context length it serves (a prompt plus its output), in tokens; None: the model's
    # config.json (`max_position_embeddings`). Without weights it may exceed the model's.
    max_model_len: int | None = None
    # An answer ends with the model's end-of-sequence token after this many tokens, as a real
    # model's answers end (0: every answer runs to max_tokens). Agents need answers that end:
    # one cut at max_tokens is continued, turn after turn.
    answer_tokens: int = 0
    timing: TimingModel = field(default_factory=TimingModel)
    # Synthetic KV size moved between prefill and decode workers (an 8B model holds ~128 KiB).
    kv_bytes_per_token: int = 4096
    # The host-memory tier below the device cache, in blocks (0: none), and the host -> device
    # link a load-back crosses (GB/s; a PCIe 5.0 x16 link moves about 50 in practice).
    host_kv_blocks: int = 0
    host_kv_gbps: float = 50.0
    # LoRA adapters (--enable-lora, --lora-modules, --max-loras, --max-lora-rank).
    lora: LoraConfig = LORA_OFF
    # Device blocks agent sessions may keep pinned between turns (-1: a quarter of the device).
    session_pin_blocks: int = -1

    @property
    def pin_budget(self) -> int:
        return self.num_gpu_blocks // 4 if self.session_pin_blocks < 0 else self.session_pin_blocks
