"""What the gateway knows of the mesh: processors per model, routers, decode and prefill workers,
and the LoRA adapters the workers serve."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import count

from services.mesh.discovery import ComponentView, InstanceInfo
from services.mesh.session_client import Session, SessionPool
from services.mesh.session_kind import PROCESSOR_SESSION
from services.mesh.turns import in_turn


@dataclass(frozen=True, slots=True)
class ModelTarget:
    """What a client's `model` names: a base model, or a LoRA adapter of one (`lora_name`)."""

    base: str
    lora_name: str = ""


@dataclass(frozen=True)
class LocalProcessor:
    """The processor a gateway hosts (--embed-processor): its registration's id and model, and the
    in-process session to it."""

    instance_id: str
    model: str
    session: Session


@dataclass
class MeshView:
    """Live views of the components the gateway needs (their lifetimes belong to the service runner)."""

    processors: ComponentView
    routers: ComponentView
    decoders: ComponentView
    sessions: SessionPool
    # The prefill pool: only the LoRA admin endpoints reach it (None: they reach decode workers alone).
    prefills: ComponentView | None = None
    # The processor this gateway hosts, taken before any other for its model.
    local: LocalProcessor | None = None
    _turn: count = field(default_factory=count)

    def models(self) -> list[str]:
        served = {i.model for i in self.decoders.instances.values()}
        return sorted(served & {p.model for p in self.processors.instances.values()})

    def knows_model(self, model: str) -> bool:
        return any(i.model == model for i in self.decoders.instances.values()) or any(
            p.model == model for p in self.processors.instances.values())

    def resolve(self, model: str) -> ModelTarget | None:
        """What `model` names, None when nothing in the mesh has that name (the caller's 404).

        A base model's name wins over an adapter of the same name (the base is what workers were
        started with). An adapter is known from the decode workers' records (each lists the
        adapters it knows); one that workers of two base models list resolves to the first base
        by name, so every gateway resolves it alike."""
        if self.knows_model(model):
            return ModelTarget(model)
        bases = sorted({i.model for i in self.decoders.instances.values() if model in i.lora_adapters})
        return ModelTarget(bases[0], model) if bases else None

    def adapters(self) -> dict[str, str]:
        """Every adapter a decode worker of a served model lists, with its base model."""
        served = set(self.models())
        out: dict[str, str] = {}
        for info in sorted(self.decoders.instances.values(), key=lambda i: i.model):
            if info.model in served:
                for name in info.lora_adapters:
                    out.setdefault(name, info.model)
        return out

    def lists_adapter(self, target: ModelTarget) -> bool:
        """Whether a decode worker of the target's base lists its adapter now."""
        return any(i.model == target.base and target.lora_name in i.lora_adapters
                   for i in self.decoders.instances.values())

    def workers(self, base: str | None = None) -> list[InstanceInfo]:
        """The decode and prefill workers (of `base` only, when given)."""
        pools = [self.decoders] if self.prefills is None else [self.decoders, self.prefills]
        return [i for pool in pools for i in pool.instances.values() if base is None or i.model == base]

    def processor_for(self, model: str, exclude: Sequence[str] = (),
                      avoid: Sequence[str] = ()) -> tuple[str, Session] | None:
        """The processor this gateway hosts, or else the next processor of `model` in turn, never
        one of `exclude` (those the request tried) and one of `avoid` (seen failing lately) only
        when no other is left: its id and the session to it. The hosted one is also registered
        like any, so once it is avoided (it failed a stream) the others are taken in turn first."""
        local = self.local
        if local is not None and local.model == model and local.instance_id not in exclude \
                and local.instance_id not in avoid:
            return local.instance_id, local.session
        candidates = in_turn((p for p in self.processors.instances.values()
                              if p.model == model and p.instance_id not in exclude),
                             next(self._turn), lambda p: p.instance_id)
        if not candidates:
            return None
        chosen = next((p for p in candidates if p.instance_id not in avoid), candidates[0])
        return chosen.instance_id, self.sessions.get(PROCESSOR_SESSION, chosen.address)

    def health(self) -> tuple[bool, str]:
        if not self.routers.instances:
            return False, "no kv-router is registered"
        models = self.models()
        if not models:
            if not self.decoders.instances:
                return False, "no decode worker is registered"
            return False, "no processor serves the decode workers' model"
        return True, "serving " + ", ".join(models)
