"""Which processor the gateway sends a request to: in turn, never one the request tried, and one
seen failing lately only when no other is left (services/frontend/mesh.py)."""

from __future__ import annotations

from services.frontend.mesh import MeshView
from services.mesh.discovery import PROCESSOR, InstanceInfo
from tests.unit.test_lora_gateway import BASE, mesh_of, view


def with_processors(*ids: str) -> MeshView:
    mesh = mesh_of()
    mesh.processors = view(PROCESSOR, *(InstanceInfo(component=PROCESSOR, instance_id=i, model=BASE,
                                                     address=f"{i}.test:1") for i in ids))
    return mesh


def chosen(mesh: MeshView, exclude: tuple[str, ...] = (), avoid: tuple[str, ...] = ()) -> str | None:
    picked = mesh.processor_for(BASE, exclude=exclude, avoid=avoid)
    return None if picked is None else picked[0]


async def test_processors_are_taken_in_turn_and_a_tried_one_never_again() -> None:
    mesh = with_processors("p1", "p2")
    assert {chosen(mesh) for _ in range(4)} == {"p1", "p2"}
    assert {chosen(mesh, exclude=("p1",)) for _ in range(4)} == {"p2"}
    assert chosen(mesh, exclude=("p1", "p2")) is None


async def test_a_processor_seen_failing_is_passed_over_while_another_is_left_and_taken_when_none_is() -> None:
    mesh = with_processors("p1", "p2")
    assert {chosen(mesh, avoid=("p1",)) for _ in range(4)} == {"p2"}
    # The healthy one left the mesh (or the request tried it): the failing one rather than a 503.
    assert chosen(mesh, exclude=("p2",), avoid=("p1",)) == "p1"
    assert chosen(mesh, avoid=("p1", "p2")) in {"p1", "p2"}
