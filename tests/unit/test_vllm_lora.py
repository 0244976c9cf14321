"""LoRA on the vLLM engine without starting it: the KV events of an adapter's blocks, vLLM's
engine arguments, the loader that speaks to `AsyncLLM`, and the adapter held for a request.
(The engine itself runs in tests/e2e/test_lora_vllm.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.engines.lora import AdapterError, AdapterErrorKind, AdapterSet, LoraConfig, LoraModule
from services.kv_protocol.events import KvStored
from services.kv_protocol.hashing import KV_HASH_SEED, adapter_seed, local_block_hashes
from services.config_error import ConfigError
from services.tools.make_demo_adapter import AdapterSpec, write_demo_adapter
from services.tools.make_demo_model import ensure_demo_model

pytestmark = pytest.mark.vllm  # imports vLLM's event and request types
BLOCK = 16
TOKENS = list(range(10, 10 + 2 * BLOCK))


@pytest.fixture(scope="module", autouse=True)
def vllm_imported() -> None:
    """vLLM's first import asks `file` about the interpreter (a child process): done once, before
    each test's guard against starting processes is set (module fixtures come first)."""
    import vllm.distributed.kv_events  # noqa: F401
    import vllm.lora.request  # noqa: F401


def stored(lora_name: str | None, tokens: list[int] = TOKENS) -> KvStored:
    from vllm.distributed.kv_events import BlockStored

    from services.engines.vllm_kv_events import convert

    event = convert(BlockStored(block_hashes=[7, 8], parent_block_hash=None, token_ids=tokens, block_size=BLOCK,
                                lora_id=1 if lora_name else None, medium="GPU", lora_name=lora_name))
    assert isinstance(event, KvStored)
    return event


def local_hashes(event: KvStored) -> list[int]:
    return [local for _, local in event.blocks]


def test_an_adapters_blocks_are_hashed_with_its_seed_and_named_in_the_event() -> None:
    event = stored("demo-lora-a")
    assert event.lora_name == "demo-lora-a"
    assert local_hashes(event) == local_block_hashes(TOKENS, BLOCK, adapter_seed("demo-lora-a"))
    assert [seq for seq, _ in event.blocks] == [7, 8]  # vLLM's own keys pass through unchanged


def test_the_base_models_blocks_keep_dynamos_hash() -> None:
    event = stored(None)
    assert event.lora_name == ""
    assert local_hashes(event) == local_block_hashes(TOKENS, BLOCK) == local_block_hashes(TOKENS, BLOCK, KV_HASH_SEED)


def test_the_same_tokens_under_two_adapters_and_the_base_share_no_local_hash() -> None:
    base, a, b = (set(local_hashes(stored(name))) for name in (None, "demo-lora-a", "demo-lora-b"))
    assert len(base) == len(a) == len(b) == 2
    assert not (base & a or base & b or a & b)


def test_vllm_gets_a_rank_it_supports_that_holds_the_workers_limit() -> None:
    from services.engines.vllm_lora import lora_engine_args, vllm_max_lora_rank

    assert [vllm_max_lora_rank(r) for r in (1, 8, 10, 16, 17, 512)] == [1, 8, 16, 16, 32, 512]
    with pytest.raises(ConfigError, match="--max-lora-rank 600"):
        vllm_max_lora_rank(600)
    assert lora_engine_args(LoraConfig()) == {}
    assert lora_engine_args(LoraConfig(enabled=True, max_loras=3, max_lora_rank=8)) == dict(
        enable_lora=True, max_loras=3, max_lora_rank=8, max_cpu_loras=3)


class StandInLLM:
    """What the loader calls on `AsyncLLM`, recorded; `refuse` / `fail` make add_lora say no / raise."""

    def __init__(self, refuse: bool = False, fail: bool = False) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.refuse, self.fail = refuse, fail

    async def add_lora(self, request: Any) -> bool:
        self.calls.append(("add", (request.lora_name, request.lora_int_id, request.lora_path)))
        if self.fail:
            raise ValueError("expected lora_A shape (8, 128)")
        return not self.refuse

    async def remove_lora(self, lora_id: int) -> bool:
        self.calls.append(("remove", lora_id))
        return True


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("adapters")
    model = ensure_demo_model()
    return (write_demo_adapter(root / "a", model, AdapterSpec(seed=1)),
            write_demo_adapter(root / "b", model, AdapterSpec(seed=2)))


def adapter_set(dirs: tuple[Path, Path], llm: StandInLLM | None, max_loras: int = 1) -> AdapterSet:
    from services.engines.vllm_lora import vllm_adapters

    config = LoraConfig(enabled=True, modules=(LoraModule("a", str(dirs[0])), LoraModule("b", str(dirs[1]))),
                        max_loras=max_loras, max_lora_rank=8)
    adapters = vllm_adapters(config, lambda: llm)
    assert adapters is not None
    return adapters


async def test_a_request_holds_its_adapter_loaded_in_vllm_under_its_id_and_path(adapter_dirs: tuple[Path, Path]) -> None:
    from services.engines.vllm_lora import held_lora

    llm = StandInLLM()
    adapters = adapter_set(adapter_dirs, llm)
    async with held_lora(adapters, "a") as lora:
        assert (lora.lora_name, lora.lora_int_id, lora.lora_path) == ("a", 1, str(adapter_dirs[0]))
        assert adapters.state(adapters.get("a")).active_requests == 1
    async with held_lora(adapters, "b") as lora:  # one slot: a is unloaded first
        assert lora.lora_int_id == 2
    assert llm.calls == [("add", ("a", 1, str(adapter_dirs[0]))), ("remove", 1), ("add", ("b", 2, str(adapter_dirs[1])))]
    async with held_lora(adapters, "") as base:
        assert base is None


async def test_an_adapter_vllm_cannot_load_is_invalid_and_stays_unloaded(adapter_dirs: tuple[Path, Path]) -> None:
    from services.engines.vllm_lora import held_lora

    for llm, words in ((StandInLLM(fail=True), "expected lora_A shape"), (StandInLLM(refuse=True), "refused")):
        adapters = adapter_set(adapter_dirs, llm)
        with pytest.raises(AdapterError, match=words) as exc:
            async with held_lora(adapters, "a"):
                pass
        assert exc.value.kind is AdapterErrorKind.INVALID
        assert not adapters.is_resident("a")


async def test_an_unknown_or_disabled_adapter_is_refused_by_name(adapter_dirs: tuple[Path, Path]) -> None:
    from services.engines.vllm_lora import held_lora, vllm_adapters

    with pytest.raises(AdapterError, match="'nope'") as unknown:
        async with held_lora(adapter_set(adapter_dirs, StandInLLM()), "nope"):
            pass
    assert unknown.value.kind is AdapterErrorKind.UNKNOWN
    assert vllm_adapters(LoraConfig(), lambda: None) is None
    with pytest.raises(AdapterError, match="'a'") as disabled:
        async with held_lora(None, "a"):
            pass
    assert disabled.value.kind is AdapterErrorKind.DISABLED


async def test_the_adapters_named_at_start_are_preloaded_up_to_max_loras(adapter_dirs: tuple[Path, Path]) -> None:
    from services.engines.vllm_lora import preload

    llm = StandInLLM()
    adapters = adapter_set(adapter_dirs, llm, max_loras=1)
    await preload(adapters)
    assert [(s.name, s.resident) for s in adapters.states()] == [("a", True), ("b", False)]
    assert [c[0] for c in llm.calls] == ["add"]


def test_a_start_module_that_is_no_adapter_fails_the_engines_construction(tmp_path: Path) -> None:
    from services.engines.vllm_lora import vllm_adapters

    config = LoraConfig(enabled=True, modules=(LoraModule("x", str(tmp_path)),))
    with pytest.raises(AdapterError, match="adapter_config.json") as exc:
        vllm_adapters(config, lambda: None)
    assert exc.value.kind is AdapterErrorKind.INVALID
