"""`x-kvmesh-route`: why the router chose the decode worker, for a client that asked.

A request with `x-kvmesh-explain: 1` (or `true`) gets it when the gateway runs with
`--allow-explain`; without the flag the request header is ignored (which worker caches which
prefix is otherwise nobody's business). The value is `; `-separated sections of space-separated
`key=value` pairs:

    mode=kv; chosen=<id> overlap=3 usage=0.125 waiting=0 logit=1.375; runner-up=<id> overlap=0 usage=0.000 waiting=1 logit=-1.000

`<id>` is a worker's instance id (as in `x-kvmesh-worker`), `overlap` the prompt blocks the
worker already caches on its device; a worker that holds further prompt blocks in host memory
only adds `host=N credit=C` after it (those blocks, and what each is worth against a device block,
services/routing/host_credit.py), and a worker whose encoder cache keeps some of the prompt's
images `encoder=B` (what that is worth in cached blocks, services/routing/encoder_credit.py);
`usage` its KV cache usage (0..1), `waiting` its queued requests as the
router counted them, `logit` the cost function's score (services/routing/cost_function.py).
Each worker's terms end with where the router's numbers of its cache come from, `kv_source=events`
(its KV events) or `kv_source=predicted` (the prompts the router sent it), and how right they were
lately, `accuracy=0.969`: the mean of min(predicted, found) / max(predicted, found) cached prompt
tokens over its last routed requests (services/routing/index_accuracy.py), left out before the
first of them reported back.
A request of a LoRA adapter names it in the first section, `mode=kv lora=NAME` (NAME
percent-encoded where it holds anything but letters, digits and `-._~:/@+`), and each worker's
terms say the adapter there before `kv_source`: `adapter=resident` (loaded, or a request of it
sent there lately, services/routing/worker_adapters.py), or `adapter=load:0.120s`, what loading
it would take there (the worker's estimate; the cost function weighs it,
services/routing/cost_function.py):

    mode=kv lora=sql-expert; chosen=<id> overlap=3 usage=0.125 waiting=0 logit=1.375 adapter=resident;
      runner-up=<id> overlap=0 usage=0.000 waiting=0 logit=-0.500 adapter=load:0.025s

(one line in the header, cut here after `;`).

A request of an agent session (x-session-id) says in the first section what its binding did,
`session=new` (bound nowhere yet), `bound` (sent to its worker), `moved` (its worker outweighed,
gone or excluded: bound anew here) or `parent` (a sub-agent placed with its parent's worker
preferred): `mode=kv session=bound; chosen=...` (services/routing/session_bindings.py).

There is no runner-up section when only one worker could take the request; `round-robin` and
`random` weigh nothing and say only `mode=...; chosen=<id>`, and the chosen worker's `adapter`
(for a LoRA request), `kv_source` and `accuracy`.
"""

from __future__ import annotations

from urllib.parse import quote

from gen.kvmesh.v1 import common_pb2
from services.kv_protocol.tier import encoder_terms, host_terms
from services.routing.explanation import session_route_name
from services.routing.worker_adapters import adapter_terms

EXPLAIN_HEADER = "x-kvmesh-explain"
ROUTE_HEADER = "x-kvmesh-route"
_KV_SOURCES = {common_pb2.RouteCandidate.KV_SOURCE_EVENTS: "events",
               common_pb2.RouteCandidate.KV_SOURCE_PREDICTED: "predicted"}


def wants_explanation(value: str | None) -> bool:
    return value is not None and value.strip().lower() in ("1", "true")


def route_header(explanation: common_pb2.RouteExplanation) -> str:
    """The header's value (format in the module docstring)."""
    lora = f" lora={lora_text(explanation.lora_name)}" if explanation.lora_name else ""
    if explanation.session:
        lora += f" session={session_route_name(explanation.session)}"
    sections = [f"mode={explanation.mode}{lora}"]
    weighed = explanation.mode == "kv"
    for role, candidate in zip(("chosen", "runner-up"), explanation.candidates):
        sections.append((_terms(role, candidate) if weighed else f"{role}={candidate.worker_id}")
                        + _provenance(candidate))
        if not weighed:
            break
    return "; ".join(sections)


def _terms(role: str, c: common_pb2.RouteCandidate) -> str:
    return (f"{role}={c.worker_id} overlap={c.overlap_blocks}{host_terms(c.host_overlap_blocks, c.host_credit)}"
            f"{encoder_terms(c.encoder_blocks)} usage={c.cache_usage:.3f} waiting={c.waiting} logit={c.logit:.3f}")


def lora_text(lora_name: str) -> str:
    """An adapter's name as the header carries it: percent-encoded where it would break the format."""
    return quote(lora_name, safe="-._~:/@+")


def _provenance(c: common_pb2.RouteCandidate) -> str:
    """` adapter=resident kv_source=events accuracy=0.969`; nothing of what the router did not say."""
    out = adapter_terms(c.adapter_resident, c.adapter_load_s) if c.HasField("adapter_resident") else ""
    if c.kv_source:
        out += f" kv_source={_KV_SOURCES.get(c.kv_source, c.kv_source)}"  # a newer router's source by number
    if c.HasField("recent_accuracy"):
        out += f" accuracy={c.recent_accuracy:.3f}"
    return out
