"""Why the router chose a worker: one decision's terms, told three ways.

- a DEBUG log line per routing decision, with every candidate's overlap blocks (and, where it
  holds some in host memory only, those and their credit), cache usage, waiting requests and
  logit, then, for a request of a LoRA adapter, the adapter there (`adapter=resident`, or
  `adapter=load:0.120s`, what loading it would take), then where the router's numbers of its
  cache come from and how right they were lately (`kv_source=events accuracy=0.969`, its
  `Provenance`; accuracy only once it has a sample) (`log_line`); the adapter's name leads
  (`lora=NAME`), then, for a request of an agent session, what its binding did
  (`session=new|bound|moved|parent`, session_bindings.py);
- attributes of the router's `route` span, for the winner and the runner-up (`span_attributes`);
- `RouteResponse.explanation` when the caller asked to `explain` (`to_proto`), which the gateway
  renders as its `x-kvmesh-route` header.

In `kv` mode the candidates are ranked as `cost_function.ranked` orders them: the chosen worker
first, then the rest by logit, so the second is the runner-up. `round-robin` and `random` weigh
nothing: they explain themselves by their mode and the chosen worker alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from opentelemetry.util.types import AttributeValue

from gen.kvmesh.v1 import common_pb2
from services.routing.cost_function import Terms, ranked
from services.routing.kv_source import KvSource
from services.routing.worker_adapters import AdapterView, adapter_terms
from services.kv_protocol.tier import encoder_terms, host_terms


# The wire's names of a prediction's source.
_KV_SOURCES = {KvSource.EVENTS: common_pb2.RouteCandidate.KV_SOURCE_EVENTS,
               KvSource.PREDICTED: common_pb2.RouteCandidate.KV_SOURCE_PREDICTED}


@dataclass(frozen=True, slots=True)
class Provenance:
    """Where the router's numbers of a worker's cache come from (its KV events, or a prediction
    from the prompts sent to it) and how right they were lately (index_accuracy.py; None before
    the worker's first sample)."""

    kv_source: KvSource
    recent_accuracy: float | None = None

    def describe(self) -> str:
        accuracy = f" accuracy={self.recent_accuracy:.3f}" if self.recent_accuracy is not None else ""
        return f" kv_source={self.kv_source}{accuracy}"

    def fill(self, candidate: common_pb2.RouteCandidate) -> common_pb2.RouteCandidate:
        candidate.kv_source = _KV_SOURCES[self.kv_source]
        if self.recent_accuracy is not None:
            candidate.recent_accuracy = self.recent_accuracy
        return candidate


@dataclass(frozen=True, slots=True)
class Explanation:
    mode: str
    chosen: str
    # Ranked terms, the chosen worker first; empty for a mode that weighs nothing.
    ranked: Sequence[Terms] = ()
    # Per worker named above, where its cache numbers come from (absent: not told).
    provenance: Mapping[str, Provenance] = field(default_factory=dict)
    # The request's LoRA adapter ("" for the base model), and per worker named above, that
    # adapter there as the decision weighed it (resident, or what loading it takes).
    lora_name: str = ""
    adapters: Mapping[str, AdapterView] = field(default_factory=dict)
    # What the request's agent session did to the choice (unspecified: no session).
    session: common_pb2.SessionRoute = common_pb2.SESSION_ROUTE_UNSPECIFIED

    @property
    def runner_up(self) -> Terms | None:
        return self.ranked[1] if len(self.ranked) > 1 else None

    def log_line(self) -> str:
        lora = f" lora={self.lora_name}" if self.lora_name else ""
        if self.session:
            lora += f" session={session_route_name(self.session)}"
        if not self.ranked:
            return f"{self.mode} mode{lora} chose {self.chosen}{self._told(self.chosen)}"
        return (f"{self.mode} mode{lora} chose {self.chosen} among {len(self.ranked)}: "
                + ", ".join(_describe(t) + self._told(t.worker_id) for t in self.ranked))

    def _told(self, worker_id: str) -> str:
        adapter = self.adapters.get(worker_id)
        provenance = self.provenance.get(worker_id)
        return ((adapter_terms(adapter.resident, adapter.load_s) if adapter is not None else "")
                + (provenance.describe() if provenance is not None else ""))

    def span_attributes(self) -> dict[str, AttributeValue]:
        out: dict[str, AttributeValue] = {"kvmesh.route.mode": self.mode, "kvmesh.route.worker_id": self.chosen,
                                          "kvmesh.route.candidates": len(self.ranked)}
        if self.lora_name:
            out["kvmesh.route.lora_name"] = self.lora_name
        if self.session:
            out["kvmesh.route.session"] = session_route_name(self.session)
        for prefix, t in (("kvmesh.route", self.ranked[0] if self.ranked else None),
                          ("kvmesh.route.runner_up", self.runner_up)):
            if t is not None:
                out.update({f"{prefix}.worker_id": t.worker_id, f"{prefix}.overlap_blocks": t.overlap_blocks,
                            f"{prefix}.cache_usage": t.cache_usage, f"{prefix}.waiting": t.waiting,
                            f"{prefix}.logit": t.logit})
                if t.host_overlap_blocks:
                    out.update({f"{prefix}.host_overlap_blocks": t.host_overlap_blocks,
                                f"{prefix}.host_credit": t.host_credit})
                if t.encoder_blocks:
                    out[f"{prefix}.encoder_blocks"] = t.encoder_blocks
                if (adapter := self.adapters.get(t.worker_id)) is not None:
                    out.update({f"{prefix}.adapter_resident": adapter.resident,
                                f"{prefix}.adapter_load_s": adapter.load_s})
        return out

    def to_proto(self) -> common_pb2.RouteExplanation:
        if not self.ranked:
            candidates = [self._provenance_of(common_pb2.RouteCandidate(worker_id=self.chosen))]
        else:
            candidates = [self._provenance_of(common_pb2.RouteCandidate(
                worker_id=t.worker_id, overlap_blocks=t.overlap_blocks, cache_usage=t.cache_usage, waiting=t.waiting,
                logit=t.logit, host_overlap_blocks=t.host_overlap_blocks, host_credit=t.host_credit,
                encoder_blocks=t.encoder_blocks))
                for t in self.ranked]
        return common_pb2.RouteExplanation(mode=self.mode, candidates=candidates, lora_name=self.lora_name,
                                           session=self.session)

    def _provenance_of(self, candidate: common_pb2.RouteCandidate) -> common_pb2.RouteCandidate:
        adapter = self.adapters.get(candidate.worker_id)
        if adapter is not None:
            candidate.adapter_resident = adapter.resident
            candidate.adapter_load_s = adapter.load_s
        provenance = self.provenance.get(candidate.worker_id)
        return provenance.fill(candidate) if provenance is not None else candidate


def explain(mode: str, chosen: str, terms: Sequence[Terms], provenance: Mapping[str, Provenance] | None = None,
            lora_name: str = "", adapters: Mapping[str, AdapterView] | None = None,
            session: common_pb2.SessionRoute = common_pb2.SESSION_ROUTE_UNSPECIFIED) -> Explanation:
    """The explanation of a pick from the mode's terms (in any order), with each worker's
    `provenance` where the caller has it, and for a request of LoRA adapter `lora_name`, that
    adapter on each worker (`adapters`)."""
    return Explanation(mode, chosen, ranked(terms, chosen) if terms else (), provenance or {}, lora_name,
                       adapters or {}, session)


def session_route_name(route: common_pb2.SessionRoute) -> str:
    """`new`, `bound`, `moved` or `parent`: how the header, logs and metrics name a session's route."""
    return common_pb2.SessionRoute.Name(route).removeprefix("SESSION_ROUTE_").lower()


def _describe(t: Terms) -> str:
    return (f"{t.worker_id} overlap={t.overlap_blocks}{host_terms(t.host_overlap_blocks, t.host_credit)}"
            f"{encoder_terms(t.encoder_blocks)} usage={t.cache_usage:.3f} waiting={t.waiting} logit={t.logit:.3f}")

