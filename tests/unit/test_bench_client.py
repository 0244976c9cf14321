"""The hot-path benchmark's measuring parts: the lean client counts events split anywhere
across socket reads and reads the usage; histogram quantiles follow Prometheus's rule."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from bench.common.mesh_metrics import quantile
from bench.hot_path.lean_client import _events


def sse_body(texts: list[str], completion_tokens: int) -> bytes:
    """What the gateway writes for a streamed completion, in HTTP/1.1 chunks (one per event)."""
    events = [b"data: " + json.dumps({"choices": [{"index": 0, "text": t}]}).encode() + b"\n\n" for t in texts]
    events.append(b"data: " + json.dumps({"choices": [], "usage": {"completion_tokens": completion_tokens}}).encode()
                  + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"


@pytest.mark.parametrize("seed", range(5))
async def test_events_split_anywhere_across_reads_are_each_counted_once(seed: int) -> None:
    rng = random.Random(seed)
    texts = [rng.choice(["a", "data: {", "é", "", "{}"]) for _ in range(60)]
    body = sse_body(texts, 77)
    reader = asyncio.StreamReader()
    at = 0
    while at < len(body):
        step = rng.randint(1, 40)
        reader.feed_data(body[at:at + step])
        at += step
    reader.feed_eof()
    stream = await _events(reader, 0.0)
    assert len(stream.arrivals) == len(texts)
    assert stream.completion_tokens == 77


def test_quantiles_interpolate_within_the_bucket_as_prometheus_does() -> None:
    buckets = {0.001: 10.0, 0.01: 30.0, 0.1: 40.0, float("inf"): 40.0}
    assert quantile(buckets, 0.25) == pytest.approx(0.001)
    assert quantile(buckets, 0.5) == pytest.approx(0.001 + 0.009 * 0.5)
    assert quantile(buckets, 1.0) == pytest.approx(0.1)
    assert quantile({0.1: 0.0, float("inf"): 0.0}, 0.5) != quantile({0.1: 0.0, float("inf"): 0.0}, 0.5)  # NaN
