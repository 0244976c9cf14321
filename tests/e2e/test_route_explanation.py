"""Why this worker: the router's explanation of a decision, from the cost function's terms to the
gateway's `x-kvmesh-route` header.

In-process first (the terms and their ranking, the router's `explain` answer per mode, the header
format), then a real mocker mesh with two workers: the header appears with `--allow-explain` and
the request header, names the worker `x-kvmesh-worker` names, and does not appear otherwise.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import httpx
import pytest

from gen.kvmesh.v1 import common_pb2, router_pb2
from services.frontend.route_header import route_header, wants_explanation
from services.routing.cost_function import Candidate, CostWeights, Terms, choose, ranked, terms
from services.routing.explanation import explain
from services.mesh.net import free_port
from tests.procs import MODEL, Etcd, Proc, ServiceMesh, service
from tests.unit.test_router_route import PROMPT, AbortingContext, cache, info, make_pool, router, set_load

W = CostWeights()
BS, TOKENS = 16, 128


def cand(wid: str, overlap: int = 0, usage: float = 0.0, waiting: int = 0, **kw) -> Candidate:  # noqa: ANN003
    return Candidate(wid, overlap, int(usage * 1000), 1000, waiting, usage, **kw)


# -- the terms and their ranking --------------------------------------------------------------


def test_each_candidates_terms_are_the_numbers_the_cost_function_weighs() -> None:
    cs = [cand("a", overlap=4, usage=0.25, waiting=1), cand("b", usage=0.5, waiting=4, pending_requests=0),
          cand("c", usage=0.1, pending_requests=2, pending_blocks=100)]
    got = terms(cs, BS, TOKENS, W)
    # waiting counts the router's own pending requests, usage its pending blocks; the logit
    # normalizes waiting by the longest queue (4): a = 2*0.5 - 0.25 - 1/4, b = -0.5 - 1, c = -0.2 - 2/4.
    assert got == [Terms("a", 4, 0.25, 1, pytest.approx(0.5)), Terms("b", 0, 0.5, 4, pytest.approx(-1.5)),
                   Terms("c", 0, pytest.approx(0.2), 2, pytest.approx(-0.7))]


def test_the_chosen_worker_leads_and_the_runner_up_is_the_best_of_the_rest() -> None:
    cs = [cand("low", usage=0.9), cand("best", overlap=6), cand("second", overlap=2), cand("third", overlap=1)]
    chosen = choose(cs, BS, TOKENS, W, random.Random(0)).worker_id
    order = [t.worker_id for t in ranked(terms(cs, BS, TOKENS, W), chosen)]
    assert order == ["best", "second", "third", "low"]


def test_a_sampled_choice_leads_even_when_another_worker_scored_better() -> None:
    all_terms = terms([cand("a", overlap=6), cand("b", overlap=2), cand("c")], BS, TOKENS, W)
    assert [t.worker_id for t in ranked(all_terms, "c")] == ["c", "a", "b"]


def test_equal_logits_rank_by_worker_id_so_the_runner_up_is_stable() -> None:
    all_terms = terms([cand("z"), cand("y"), cand("x")], BS, TOKENS, W)
    assert [t.worker_id for t in ranked(all_terms, "z")] == ["z", "x", "y"]


def test_the_log_line_names_every_candidate_with_its_terms() -> None:
    e = explain("kv", "b", terms([cand("a", usage=0.5, waiting=2), cand("b", overlap=4)], BS, TOKENS, W))
    assert e.log_line() == ("kv mode chose b among 2: b overlap=4 usage=0.000 waiting=0 logit=1.000, "
                            "a overlap=0 usage=0.500 waiting=2 logit=-1.500")
    assert explain("random", "b", []).log_line() == "random mode chose b"


# -- the router's answer ----------------------------------------------------------------------


async def route(r, explain_it: bool = True) -> router_pb2.RouteResponse:  # noqa: ANN001
    request = router_pb2.RouteRequest(request_id="r", model="m", token_ids=PROMPT, explain=explain_it)
    return await r.servicer.Route(request, AbortingContext())


async def test_kv_mode_explains_the_winner_and_the_runner_up_as_it_weighed_them() -> None:
    pool = make_pool(info("a"), info("b"), info("c"))
    cache(pool, "b", PROMPT[:8])  # two of the prompt's four blocks
    set_load(pool, "a", num_requests_waiting=2)
    set_load(pool, "c", gpu_cache_usage_perc=0.5)  # type: ignore[arg-type]
    reply = await route(router(pool))
    e = reply.explanation
    assert reply.worker_id == "b" and e.mode == "kv"
    assert [c.worker_id for c in e.candidates] == ["b", "c", "a"]
    b, c, a = e.candidates
    assert (b.overlap_blocks, b.waiting, b.logit) == (2, 0, pytest.approx(1.0))
    assert (c.cache_usage, c.logit) == (pytest.approx(0.5), pytest.approx(-0.5))
    # The terms are those before this request's own pending work was added to the winner.
    assert (a.waiting, a.logit) == (2, pytest.approx(-1.0))


async def test_no_explanation_unless_asked() -> None:
    reply = await route(router(make_pool(info("a"), info("b"))), explain_it=False)
    assert not reply.HasField("explanation")


@pytest.mark.parametrize("mode", ["round-robin", "random"])
async def test_modes_that_weigh_nothing_explain_with_their_mode_and_the_chosen_worker(mode: str) -> None:
    reply = await route(router(make_pool(info("a"), info("b")), mode=mode))
    assert reply.explanation.mode == mode
    assert [c.worker_id for c in reply.explanation.candidates] == [reply.worker_id]


# -- the header -------------------------------------------------------------------------------


def test_the_header_has_the_mode_the_chosen_worker_and_the_runner_up_with_their_terms() -> None:
    e = common_pb2.RouteExplanation(mode="kv", candidates=[
        common_pb2.RouteCandidate(worker_id="w1", overlap_blocks=3, cache_usage=0.125, waiting=0, logit=1.375),
        common_pb2.RouteCandidate(worker_id="w2", overlap_blocks=0, cache_usage=0.0, waiting=1, logit=-1.0),
        common_pb2.RouteCandidate(worker_id="w3", logit=-2.0)])
    assert route_header(e) == ("mode=kv; chosen=w1 overlap=3 usage=0.125 waiting=0 logit=1.375; "
                               "runner-up=w2 overlap=0 usage=0.000 waiting=1 logit=-1.000")
    alone = common_pb2.RouteExplanation(mode="kv", candidates=e.candidates[:1])
    assert route_header(alone) == "mode=kv; chosen=w1 overlap=3 usage=0.125 waiting=0 logit=1.375"
    rr = common_pb2.RouteExplanation(mode="round-robin", candidates=[common_pb2.RouteCandidate(worker_id="w1")])
    assert route_header(rr) == "mode=round-robin; chosen=w1"


@pytest.mark.parametrize(("value", "wanted"), [("1", True), ("true", True), (" TRUE ", True), ("0", False),
                                               ("", False), ("yes please", False), (None, False)])
def test_the_request_header_asks_with_1_or_true(value: str | None, wanted: bool) -> None:
    assert wants_explanation(value) is wanted


# -- a real mesh ------------------------------------------------------------------------------


def parse_route(header: str) -> dict[str, dict[str, str]]:
    """`mode=kv; chosen=<id> k=v ...; runner-up=<id> k=v ...` as {"mode": {...}, "chosen": {...}, ...}."""
    out = {}
    for section in header.split("; "):
        pairs = dict(p.split("=", 1) for p in section.split(" "))
        role = next(iter(pairs))
        out[role] = pairs
    return out


@pytest.fixture(scope="module")
def explained(etcd: Etcd) -> Iterator[tuple[ServiceMesh, Proc, int]]:
    """Two mocker workers behind an explaining gateway (the router logging at DEBUG), and a second
    gateway on the same mesh without --allow-explain."""
    mesh = ServiceMesh(etcd.endpoint, frontend_flags=("--allow-explain",), router_flags=("--log-level", "debug"))
    try:
        mesh.worker("--num-workers", "2")
        plain_port = free_port()
        plain = service("services.frontend", "--etcd-endpoints", etcd.endpoint, "--namespace", mesh.namespace,
                        "--http-port", str(plain_port), name="frontend-plain")
        mesh.procs.append(plain)
        plain.wait_for("listening on", 60)
        yield mesh, mesh.procs[0], plain_port
    finally:
        mesh.stop()


def post(port: int, headers: dict[str, str], stream: bool = False) -> httpx.Response:
    body = {"model": MODEL, "prompt": "explain this routing decision to me", "max_tokens": 3, "stream": stream}
    return httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, headers=headers, timeout=30)


@pytest.mark.parametrize("stream", [False, True])
def test_an_explained_request_names_the_chosen_worker_and_the_runner_up(
        explained: tuple[ServiceMesh, Proc, int], stream: bool) -> None:
    mesh, router_proc, _ = explained
    r = post(mesh.port, {"x-kvmesh-explain": "1"}, stream)
    assert r.status_code == 200, r.text
    route = parse_route(r.headers["x-kvmesh-route"])
    assert route["mode"] == {"mode": "kv"}
    assert route["chosen"]["chosen"] == r.headers["x-kvmesh-worker"]
    assert route["runner-up"]["runner-up"] not in ("", route["chosen"]["chosen"])
    for terms_of in (route["chosen"], route["runner-up"]):
        assert re.fullmatch(r"\d+", terms_of["overlap"]) and re.fullmatch(r"\d+", terms_of["waiting"])
        assert 0 <= float(terms_of["usage"]) <= 1 and re.fullmatch(r"-?\d+\.\d{3}", terms_of["logit"])
    # The router logged the decision at DEBUG, with both candidates' terms.
    chosen = route["chosen"]["chosen"]
    line = router_proc.wait_for(rf"kv mode chose {chosen} among 2: {chosen} overlap=\d+ usage=\S+ waiting=\d+ "
                                rf"logit=\S+ kv_source=events( accuracy=\S+)?, \w+ overlap=", 10).string
    assert re.search(r"request \w+", line)


def test_no_explanation_without_the_request_header(explained: tuple[ServiceMesh, Proc, int]) -> None:
    mesh, _, _ = explained
    r = post(mesh.port, {})
    assert r.status_code == 200 and "x-kvmesh-route" not in r.headers and "x-kvmesh-worker" in r.headers


def test_a_gateway_without_allow_explain_ignores_the_request_header(explained: tuple[ServiceMesh, Proc, int]) -> None:
    _, _, plain_port = explained
    r = post(plain_port, {"x-kvmesh-explain": "1"})
    assert r.status_code == 200 and "x-kvmesh-route" not in r.headers and "x-kvmesh-worker" in r.headers
