"""The context length a model is served with: the smallest its decode workers publish
(services/contract/served_context.py), and the processor's limit that follows it, with the
model's config.json standing in while no worker publishes one (services/processor/context_limit.py)."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest

from services.contract.served_context import served_context
from services.mesh.discovery import DECODE_WORKER, ComponentView, InstanceInfo
from services.mesh.etcd_store import KeyValueStore
from services.processor.context_limit import ContextLimit

MODEL = "m"
CONFIG_CONTEXT = 4096


def worker(instance_id: str, max_model_len: object = None, model: str = MODEL) -> InstanceInfo:
    extra = {} if max_model_len is None else {"max_model_len": max_model_len}
    return InstanceInfo(component=DECODE_WORKER, instance_id=instance_id, model=model, extra=extra)


@pytest.mark.parametrize("name, workers, served", [
    ("no worker", [], None),
    ("one worker", [worker("a", 200_000)], 200_000),
    ("the smallest of several", [worker("a", 200_000), worker("b", 8192), worker("c", 32768)], 8192),
    ("workers of another model do not count", [worker("a", 8192), worker("b", 1024, model="other")], 8192),
    ("only another model's workers", [worker("b", 1024, model="other")], None),
    ("a worker that publishes none does not count", [worker("a"), worker("b", 8192)], 8192),
    ("nor one that publishes no positive int", [worker("a", "big"), worker("b", 0), worker("c", True)], None),
])
def test_the_served_context_is_the_smallest_a_decode_worker_of_the_model_publishes(
        name: str, workers: list[InstanceInfo], served: int | None) -> None:
    assert served_context(workers, MODEL) == served, name


def test_the_limit_follows_workers_joining_and_leaving_and_is_the_config_while_none_is_known() -> None:
    limit = ContextLimit(MODEL, CONFIG_CONTEXT)
    assert limit.tokens == CONFIG_CONTEXT  # no worker known yet: config.json's max_position_embeddings
    limit.heard("a", worker("a", 200_000))
    assert limit.tokens == 200_000  # past the config's: the engine's is what is served
    limit.heard("b", worker("b", 8192))
    assert limit.tokens == 8192  # a request may be routed to either
    limit.heard("other", worker("other", 1024, model="other"))
    assert limit.tokens == 8192
    limit.heard("b", None)
    assert limit.tokens == 200_000
    limit.heard("a", worker("a", 100_000))  # a worker's record changed
    assert limit.tokens == 100_000
    limit.heard("a", None)
    assert limit.tokens == CONFIG_CONTEXT


def test_the_limit_starts_from_the_workers_already_in_the_view() -> None:
    view = ComponentView(cast(KeyValueStore, None), "ns", DECODE_WORKER)
    view.instances = {"a": worker("a", 65536), "b": worker("b", 131072)}
    limit = ContextLimit(MODEL, CONFIG_CONTEXT)
    limit.follow(view)
    assert limit.tokens == 65536


async def test_each_change_is_heard_and_changes_close_together_as_the_latest() -> None:
    limit = ContextLimit(MODEL, CONFIG_CONTEXT)
    heard = limit.changes()
    limit.heard("a", worker("a", 8192))
    limit.heard("b", worker("b", 2048))
    assert await asyncio.wait_for(anext(heard), 1) == 2048
    limit.heard("c", worker("c", 200_000))  # not the smallest: no change
    limit.heard("b", None)
    assert await asyncio.wait_for(anext(heard), 1) == 8192
