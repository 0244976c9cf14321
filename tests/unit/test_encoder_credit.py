"""The router's encoder-cache credit (services/routing/encoder_credit.py): a worker whose engine
keeps an image's features is worth more to a prompt with that image, by what encoding it again
would cost; and the workers' load streams carry their encoder caches, in the first report and
when they change only."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gen.kvmesh.v1 import worker_pb2
from services.engines.base import ImageLoad, LoadSnapshot
from services.kv_protocol.media import MediaSpan
from services.routing.cost_function import CostModel, CostWeights
from services.routing.encoder_credit import ENCODER_HIT_WEIGHT, encoder_blocks
from services.routing.route_query import RouteQuery
from services.routing.worker_images import MAX_SENT, SENT_GRACE_S, WorkerImages
from services.worker.kv_event_log import KvEventLog
from services.worker.servicer import WorkerServicer
from tests.unit.adapter_engine import AdapterEngine
from tests.unit.test_router import router
from tests.unit.test_router_route import BS, MODEL, cache, info, make_pool

SHOT, OTHER = 0x1111_2222_3333_4444, 0x5555_6666_7777_8888
IMAGE = MediaSpan(SHOT, 4 * BS, 2 * BS)  # the prompt's blocks 4 and 5


def holding(pool: Any, worker_id: str, *digests: int) -> None:
    pool.workers[worker_id].observe_load(worker_pb2.LoadMetrics(encoder_cache=worker_pb2.EncoderCache(digests=digests)))


def test_an_image_held_counts_its_tokens_after_the_cached_prefix_at_the_weight_once() -> None:
    pool = make_pool(info("a"), info("b"), info("c"))
    holding(pool, "a", SHOT)
    holding(pool, "b", SHOT, OTHER)
    workers = list(pool.workers.values())
    media = [IMAGE, MediaSpan(SHOT, 8 * BS, 2 * BS)]  # the same screenshot twice: encoded once
    assert encoder_blocks(workers, media, {}, {}, BS) == {"a": 2 * ENCODER_HIT_WEIGHT, "b": 2 * ENCODER_HIT_WEIGHT}
    # Half the image in b's cached blocks: still encoded whole there, but only the rest is credited.
    assert encoder_blocks(workers, [IMAGE], {"b": 5}, {}, BS)["b"] == pytest.approx(ENCODER_HIT_WEIGHT)
    # All of it in cached blocks (device, then host): nothing to encode, nothing credited.
    assert "b" not in encoder_blocks(workers, [IMAGE], {"b": 5}, {"b": 1}, BS)
    assert encoder_blocks(workers, [], {}, {}, BS) == {}


def test_a_report_without_the_encoder_cache_keeps_the_last_one() -> None:
    pool = make_pool(info("a"))
    holding(pool, "a", SHOT)
    pool.workers["a"].observe_load(worker_pb2.LoadMetrics(kv_active_blocks=3))
    assert pool.workers["a"].images.keeps(SHOT)
    holding(pool, "a")  # an empty set, sent: the cache was emptied
    assert not pool.workers["a"].images.keeps(SHOT) and pool.workers["a"].images.reports


def test_the_images_routed_to_a_worker_count_as_kept_there_for_a_while() -> None:
    now = [0.0]
    pool = make_pool(info("a"), info("b"))
    for state in pool.workers.values():
        state.images.clock = lambda: now[0]
    holding(pool, "a")
    r, _ = router(pool)
    prompt = list(range(100, 100 + 8 * BS))
    for worker in ("a", "b"):
        query = RouteQuery(worker, MODEL, prompt, exclude=frozenset({"a", "b"} - {worker}),
                           media=(MediaSpan(SHOT, 4 * BS, 4 * BS),))
        assert r.decide(query).worker_id == worker
    assert pool.workers["a"].images.keeps(SHOT)
    assert not pool.workers["b"].images.keeps(SHOT)  # it reports no encoder cache: nothing is credited
    holding(pool, "a", OTHER)  # a report that came before the worker encoded it
    assert pool.workers["a"].images.keeps(SHOT) and pool.workers["a"].images.keeps(OTHER)
    # A worker that never reports keeping it (its prompts prefilled elsewhere) is not credited long.
    now[0] = SENT_GRACE_S
    assert not pool.workers["a"].images.keeps(SHOT) and pool.workers["a"].images.keeps(OTHER)


def test_the_images_sent_are_bounded() -> None:
    images = WorkerImages(reported=frozenset())
    images.routed(range(MAX_SENT + 10))
    assert len(images.sent) == MAX_SENT and not images.keeps(0) and images.keeps(MAX_SENT + 9)


@pytest.mark.parametrize("model", [CostModel.CACHED_SHARE, CostModel.DYNAMO])
def test_the_worker_keeping_the_image_wins_over_a_slightly_less_busy_one(model: CostModel) -> None:
    prompt = list(range(100, 100 + 8 * BS))
    image = MediaSpan(SHOT, 4 * BS, 4 * BS)  # the prompt's last four blocks

    def chosen(kept: tuple[int, ...]) -> str:
        pool = make_pool(info("a"), info("b"))
        for worker in ("a", "b"):
            cache(pool, worker, prompt[:BS])  # the same cached prefix on both
        # b a little busier, and keeping the images `kept`.
        pool.workers["b"].observe_load(worker_pb2.LoadMetrics(
            kv_active_blocks=1, kv_total_blocks=1000, gpu_cache_usage_perc=0.05,
            encoder_cache=worker_pb2.EncoderCache(digests=kept)))
        r, _ = router(pool, weights=CostWeights(model=model))
        return r.decide(RouteQuery("r", MODEL, prompt, media=(image,))).worker_id

    assert chosen(()) == "a"
    assert chosen((SHOT,)) == "b"


class ImageEngine(AdapterEngine):
    """Reports an encoder cache that a test changes."""

    def __init__(self) -> None:
        super().__init__(None)
        self.cached: frozenset[int] = frozenset()

    def load(self) -> LoadSnapshot:
        return LoadSnapshot(request_total_slots=8, images=ImageLoad(0, 0, 0, cached=self.cached))


async def test_the_load_stream_carries_the_encoder_cache_first_and_when_it_changes() -> None:
    engine = ImageEngine()
    stream = WorkerServicer(engine, "w1", KvEventLog()).SubscribeMetrics(worker_pb2.SubscribeMetricsRequest(),
                                                                           None)  # type: ignore[arg-type]
    first = await anext(stream)
    assert first.HasField("encoder_cache") and list(first.encoder_cache.digests) == []
    engine.cached = frozenset({SHOT})
    changed = await asyncio.wait_for(anext(stream), 5)
    assert list(changed.encoder_cache.digests) == [SHOT]
    # Nothing changed: the next report (at the stream's longest interval) leaves it out.
    again = await asyncio.wait_for(anext(stream), 5)
    assert not again.HasField("encoder_cache")
    await stream.aclose()
