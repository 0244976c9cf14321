"""The planner on real processes: a launched mocker mesh, real etcd, real load.

- `--planner local` grows the prefill pool under a burst of long prompts and, given encode
  workers, the encode pool under a burst of images its one worker cannot encode in time, and
  shrinks both after, losing no request;
- `--planner none` plans the same and changes nothing;
- the traffic it reads from the frontends' metrics, in-process.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import random
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import httpx
import pytest
from PIL import Image

from services.mesh.discovery import DECODE_WORKER, ENCODE_WORKER, PLANNER, PREFILL_WORKER
from services.profiles.profile_file import DEFAULT_PRESET, load_profile
from services.planner.traffic import Counters, parse_counters, traffic_of
from testkit.metrics import metrics_url, scrape, total
from tests.procs import MODEL, Etcd, Mesh, registered, wait_until

# Fast decisions for a test: a plan every 2 s, a pool may change again 4 s after it changed.
PLANNER_FLAGS = ("--adjustment-interval", "2", "--cooldown", "4", "--max-prefill-workers", "3",
                 "--ttft-slo-ms", "400", "--itl-slo-ms", "100")
# Long prompts (remote prefill) at a rate one prefill worker cannot keep up with: 2500 tokens take
# ~205 ms on the default profile, so 6 req/s need more than one.
BURST_PROMPT, BURST_RATE, BURST_S = 2500, 6.0, 14.0


def launch(etcd: Etcd, planner: str) -> Mesh:
    return Mesh.launch(etcd.endpoint, f"plan-{uuid.uuid4().hex[:6]}", "mocker", "--prefill-workers", "1",
                       "--max-local-prefill-length", "512", "--planner", planner, *PLANNER_FLAGS)


def pools(mesh: Mesh) -> tuple[int, int]:
    return (len(registered(mesh.etcd, mesh.namespace, PREFILL_WORKER)),
            len(registered(mesh.etcd, mesh.namespace, DECODE_WORKER)))


def planner_metric(mesh: Mesh, name: str, **labels: str) -> float:
    (info,) = registered(mesh.etcd, mesh.namespace, PLANNER)
    return total(scrape(metrics_url(info.metrics_port)), name, **labels)


def long_prompt(mesh: Mesh, seed: int, model: str = MODEL) -> int:
    prompt = [random.Random(seed).randrange(20, 1000) for _ in range(BURST_PROMPT)]
    r = httpx.post(f"{mesh.base_url}/completions", json={"model": model, "prompt": prompt, "max_tokens": 4},
                   timeout=120)
    return r.status_code


def burst(mesh: Mesh, stop: threading.Event, seconds: float = BURST_S, rate: float = BURST_RATE,
          send: Callable[[Mesh, int], int] = long_prompt) -> list[int]:
    """Requests (`send`, long prompts by default), Poisson arrivals, until `stop` or `seconds`'
    worth; returns every status."""
    rng = random.Random(7)
    with ThreadPoolExecutor(32) as pool:
        futures = []
        while not stop.wait(rng.expovariate(rate)) and len(futures) < rate * seconds:
            futures.append(pool.submit(send, mesh, len(futures)))
        return [f.result() for f in futures]


def test_traffic_is_the_difference_between_two_readings() -> None:
    text = """# TYPE kvmesh_frontend_request_duration_seconds histogram
kvmesh_frontend_request_duration_seconds_count 10
kvmesh_frontend_request_duration_seconds_sum 5
# TYPE kvmesh_frontend_prompt_tokens counter
kvmesh_frontend_prompt_tokens_total 20000
# TYPE kvmesh_frontend_completion_tokens counter
kvmesh_frontend_completion_tokens_total 500
# TYPE kvmesh_frontend_time_to_first_token_seconds histogram
kvmesh_frontend_time_to_first_token_seconds_count 10
kvmesh_frontend_time_to_first_token_seconds_sum 3
# TYPE kvmesh_frontend_inter_token_latency_seconds histogram
kvmesh_frontend_inter_token_latency_seconds_count 490
kvmesh_frontend_inter_token_latency_seconds_sum 9.8
"""
    later = parse_counters(text)
    earlier = Counters(requests=4, prompt_tokens=8000, completion_tokens=200, ttft_sum=1, ttft_count=4,
                       itl_sum=3.9, itl_count=196)
    t = traffic_of(later.minus(earlier), seconds=2.0)
    assert t.rate_per_s == pytest.approx(3.0)
    assert t.mean_input_tokens == pytest.approx(2000)
    assert t.mean_output_tokens == pytest.approx(50)
    assert t.observed_ttft_s == pytest.approx(2 / 6)
    assert t.observed_itl_s == pytest.approx(5.9 / 294)
    # A frontend that restarted (its counters went down) counts from zero, never negative.
    assert later.minus(Counters(requests=50, ttft_count=50)) == later
    assert traffic_of(Counters(), 2.0).idle


def test_dry_run_plans_but_changes_nothing(etcd: Etcd) -> None:
    mesh = launch(etcd, "none")
    try:
        stop = threading.Event()
        with ThreadPoolExecutor(1) as driver:
            # Up to three times the usual burst: this test is about a plan that changes nothing,
            # not how soon the plan comes (once in a full suite, 14 s of burst left it undecided).
            load = driver.submit(burst, mesh, stop, 3 * BURST_S)
            planned = wait_until(lambda: planner_metric(mesh, "kvmesh_planner_desired_workers", role="prefill") > 1,
                                 60, interval_s=0.5)
            stop.set()
            assert all(s == 200 for s in load.result())
        assert planned, "the dry run never planned a larger prefill pool under the burst"
        assert pools(mesh) == (1, 1)
        assert planner_metric(mesh, "kvmesh_planner_actual_workers", role="prefill") == 1
        assert planner_metric(mesh, "kvmesh_planner_switches_total") == 0
        assert planner_metric(mesh, "kvmesh_planner_scale_events_total") == 0
        assert planner_metric(mesh, "kvmesh_planner_decisions_total") >= 1
    finally:
        assert mesh.stop() == 0


# Images of 0.2 s each (the mocker's encoder, from the profile) at 6 a second: 1.2 erlangs, more
# than one encode worker can take; three keep the wait within a tenth of the TTFT objective.
IMAGE_ENCODE_S, IMAGE_RATE = 0.2, 6.0
VLM, VLM_DIR = "demo-vlm", ".cache/models/kvmesh-demo-vlm"


def image_request(mesh: Mesh, seed: int) -> int:
    out = io.BytesIO()
    Image.new("RGB", (64, 48), (seed % 256, seed // 256 % 256, 90)).save(out, "PNG")  # a new image each time
    url = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    body = {"model": VLM, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": url}}]}]}
    return httpx.post(f"{mesh.base_url}/chat/completions", json=body, timeout=120).status_code


def test_local_planner_grows_the_prefill_and_encode_pools_under_bursts_and_shrinks_them_after(
        etcd: Etcd, tmp_path: Path) -> None:
    """Both bursts at once on one mesh (a mesh costs seconds to start): long prompts for the prefill
    pool, new images for the encode pool; each pool grows, then goes back to its floor."""
    preset = load_profile(DEFAULT_PRESET)
    profile = tmp_path / "slow-encoder.json"
    profile.write_text(dataclasses.replace(preset, cost=dataclasses.replace(preset.cost, encode_base_s=IMAGE_ENCODE_S))
                       .to_json())
    mesh = Mesh.launch(etcd.endpoint, f"plan-{uuid.uuid4().hex[:6]}", "mocker", "--model", VLM_DIR,
                       "--served-model-name", VLM, "--prefill-workers", "1", "--max-local-prefill-length", "512",
                       "--encode-workers", "1", "--timing-profile", str(profile), "--planner", "local", *PLANNER_FLAGS)

    def encoders() -> int:
        return len(registered(mesh.etcd, mesh.namespace, ENCODE_WORKER))

    def scaled(role: str, direction: str) -> bool:
        return planner_metric(mesh, "kvmesh_planner_scale_events_total", role=role, direction=direction) >= 1

    try:
        assert pools(mesh) == (1, 1) and encoders() == 1
        long_stop, image_stop = threading.Event(), threading.Event()
        with ThreadPoolExecutor(2) as driver:
            long = driver.submit(burst, mesh, long_stop, BURST_S, BURST_RATE, partial(long_prompt, model=VLM))
            images = driver.submit(burst, mesh, image_stop, BURST_S, IMAGE_RATE, image_request)
            prefill_grew = wait_until(lambda: pools(mesh)[0] > 1, 60, interval_s=0.5)
            long_stop.set()
            encode_grew = wait_until(lambda: encoders() > 1, 60, interval_s=0.5)
            image_stop.set()
            statuses = long.result() + images.result()
        assert prefill_grew, f"the prefill pool never grew: {mesh.launcher.tail()}"
        assert encode_grew, f"the encode pool never grew: {mesh.launcher.tail()}"
        assert statuses and all(s == 200 for s in statuses), statuses
        # Counted when the launcher answers the start, which is just after the worker registers.
        assert wait_until(lambda: scaled("prefill", "up") and scaled("encode", "up"), 30, interval_s=0.5)
        assert planner_metric(mesh, "kvmesh_planner_encode_seconds") == pytest.approx(IMAGE_ENCODE_S, rel=0.5)
        # No load: each pool down to its floor (the encode pool's is 0: images are then encoded in place).
        assert wait_until(lambda: pools(mesh) == (1, 1) and encoders() == 0, 60, interval_s=0.5), \
            f"never shrank back: {pools(mesh)}, {encoders()} encode workers"
        # Counted once the stopped workers' processes have exited (after their drain).
        assert wait_until(lambda: scaled("prefill", "down") and scaled("encode", "down"), 60, interval_s=0.5)
        assert planner_metric(mesh, "kvmesh_planner_desired_workers", role="prefill") == 1
        assert planner_metric(mesh, "kvmesh_planner_desired_workers", role="encode") == 0
    finally:
        assert mesh.stop() == 0
