"""What the gateway knows of the mesh: processors per model, routers, decode workers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import count

from services.mesh.discovery import ComponentView
from services.mesh.session_client import Session, SessionPool
from services.mesh.session_kind import PROCESSOR_SESSION
from services.mesh.turns import in_turn


@dataclass
class MeshView:
    """Live views of the components the gateway needs (their lifetimes belong to the service runner)."""

    processors: ComponentView
    routers: ComponentView
    decoders: ComponentView
    sessions: SessionPool
    _turn: count = field(default_factory=count)

    def models(self) -> list[str]:
        served = {i.model for i in self.decoders.instances.values()}
        return sorted(served & {p.model for p in self.processors.instances.values()})

    def knows_model(self, model: str) -> bool:
        return any(i.model == model for i in self.decoders.instances.values()) or any(
            p.model == model for p in self.processors.instances.values())

    def processor_for(self, model: str, exclude: Sequence[str] = ()) -> tuple[str, Session] | None:
        """The next processor of `model` in turn, skipping `exclude`: its id and the session to it."""
        candidates = in_turn((p for p in self.processors.instances.values()
                              if p.model == model and p.instance_id not in exclude),
                             next(self._turn), lambda p: p.instance_id)
        if not candidates:
            return None
        chosen = candidates[0]
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
