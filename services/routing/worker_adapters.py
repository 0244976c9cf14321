"""What the router knows of one worker's LoRA adapters: which it knows, which it holds resident
(loaded), and what loading one would cost there.

Two sources, the worker's and the router's own:
- the worker's: its etcd record lists the adapters it knows (`InstanceInfo.lora_adapters`), and
  each load report every known adapter's state (`LoadMetrics.lora_adapters`: resident or not,
  `load_s` the worker's estimate of loading it now, its running requests) and `max_loras`;
- the router's: an adapter of a request this router sent to the worker within the last
  `PENDING_ADAPTER_S` is taken as resident there, whatever the reports say, until a report says
  it is. The worker loads it for that request (or holds it already), but its reports lag behind
  by up to a period, and a request queued behind others loads it only when it starts: without
  this a burst of one adapter's requests would find it cold everywhere and load it on every
  worker at once. `PENDING_ADAPTER_S` covers a report period and a short queue; a worker that
  evicts the adapter meanwhile (its `max_loras` slots taken by others) costs one load more.

A worker whose `max_loras` slots all hold adapters with running requests cannot load another
until one of them ends (the engine's request waits, up to its bound, then ends busy): the view
says `slots_busy`, and its load counts `SLOTS_BUSY_WAIT_S` more, so such a worker is a last resort.

The base model ("") is known everywhere and never loaded.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from gen.kvmesh.v1 import worker_pb2

# How long a request of an adapter this router sent to a worker stands for the adapter being
# resident there, unless a report confirms it sooner (see the module docstring).
PENDING_ADAPTER_S = 2.0
# What loading an adapter is taken to cost on a worker that knows it (its etcd record says so)
# but has not reported its state yet: a 100 MB adapter at the engines' default 2 GB/s, plus
# their fixed part (services/engines/lora.py), so an unreported worker is neither free nor shunned.
UNREPORTED_LOAD_S = 0.07
# What a request waits on a worker whose slots are all busy before its adapter can load (a guess:
# a running request's remaining time), added to the load.
SLOTS_BUSY_WAIT_S = 2.0


@dataclass(frozen=True, slots=True)
class AdapterView:
    """One adapter on one worker, as a routing decision weighs it."""

    # Loaded there (reported), or a request of it sent there lately (pending).
    resident: bool
    # What loading it would take there: 0 when resident.
    load_s: float = 0.0
    # Every slot of the worker holds an adapter with running requests: the load must wait.
    slots_busy: bool = False


RESIDENT = AdapterView(True)


@dataclass(slots=True)
class WorkerAdapters:
    """One worker's adapters: its latest report (`observe`) and this router's dispatches
    (`dispatched`)."""

    # Per adapter name, its state in the worker's latest load report.
    reported: Mapping[str, worker_pb2.LoraAdapterState] = field(default_factory=dict)
    # Adapters the worker keeps loaded at once (0: LoRA off, or not reported yet).
    max_loras: int = 0
    # Per adapter name, when this router last sent the worker a request of it.
    pending: dict[str, float] = field(default_factory=dict)

    def observe(self, load: worker_pb2.LoadMetrics, now: float | None = None) -> None:
        """The worker's latest load report: its states replace the last ones; a pending adapter
        it reports resident needs the router's word no more, nor one pending too long."""
        self.reported = {state.lora_name: state for state in load.lora_adapters}
        self.max_loras = load.max_loras
        if self.pending:
            horizon = (time.monotonic() if now is None else now) - PENDING_ADAPTER_S
            for name in [n for n, sent in self.pending.items() if sent <= horizon or self._reported_resident(n)]:
                del self.pending[name]

    def _reported_resident(self, lora_name: str) -> bool:
        state = self.reported.get(lora_name)
        return state is not None and state.resident

    def dispatched(self, lora_name: str, now: float | None = None) -> None:
        """This router sent the worker a request of adapter `lora_name`."""
        if lora_name:
            self.pending[lora_name] = time.monotonic() if now is None else now

    def knows(self, lora_name: str, registered: tuple[str, ...] = ()) -> bool:
        """Whether the worker serves adapter `lora_name` (always, the base model): its etcd
        record (`registered`) or its latest report lists it."""
        return not lora_name or lora_name in registered or lora_name in self.reported

    def view(self, lora_name: str, now: float | None = None) -> AdapterView:
        """Adapter `lora_name` on this worker (the base model: resident)."""
        if not lora_name:
            return RESIDENT
        if self._reported_resident(lora_name):
            return RESIDENT
        sent = self.pending.get(lora_name)
        if sent is not None:
            if (time.monotonic() if now is None else now) - sent < PENDING_ADAPTER_S:
                return RESIDENT
            del self.pending[lora_name]  # expired: the reports speak for it again
        state = self.reported.get(lora_name)
        load_s = state.load_s if state is not None else UNREPORTED_LOAD_S
        if self.slots_busy():
            return AdapterView(False, load_s + SLOTS_BUSY_WAIT_S, slots_busy=True)
        return AdapterView(False, load_s)

    def slots_busy(self) -> bool:
        """Every one of the worker's slots (as last reported) holds an adapter with running requests."""
        resident = [s for s in self.reported.values() if s.resident]
        return self.max_loras > 0 and len(resident) >= self.max_loras and all(s.active_requests for s in resident)


def adapter_terms(resident: bool, load_s: float) -> str:
    """How a routing explanation shows the request's adapter on a worker (the router's DEBUG line
    and the gateway's `x-kvmesh-route` header alike): ` adapter=resident`, or
    ` adapter=load:0.120s`, what loading it there would take."""
    return " adapter=resident" if resident else f" adapter=load:{load_s:.3f}s"
