"""Imports point one way: services -> worker plumbing -> mesh plumbing; engines stand alone; bench
never leans on tests. Read from the source with `ast`, so a late (function-level) import counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.procs import ROOT

SERVICE_PACKAGES = ("frontend", "processor", "kv_router", "decode_worker", "prefill_worker", "launch", "planner")
# Pure helpers of the mesh package that engines may use: the wire-level block hash, the KV tier and
# a free port.
ENGINE_MAY_USE = ("services.mesh.hashing", "services.mesh.kv_tier", "services.mesh.net")


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def modules_under(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def offending(folder: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> list[str]:
    out = []
    for path in modules_under(folder):
        for name in sorted(imports_of(path)):
            if name.startswith(forbidden) and not name.startswith(allowed):
                out.append(f"{path.relative_to(ROOT)} imports {name}")
    return out


def test_the_mesh_package_imports_no_engine_worker_or_service() -> None:
    forbidden = ("services.engines", "services.worker", *(f"services.{p}" for p in SERVICE_PACKAGES))
    assert offending("services/mesh", forbidden) == []


def test_engines_import_nothing_of_the_mesh_but_its_pure_helpers() -> None:
    assert offending("services/engines", ("services.",), ("services.engines", *ENGINE_MAY_USE)) == []


def test_the_worker_package_imports_no_service() -> None:
    assert offending("services/worker", tuple(f"services.{p}" for p in SERVICE_PACKAGES)) == []


def test_benchmarks_never_import_the_tests() -> None:
    assert offending("bench", ("tests",)) == []


@pytest.mark.parametrize("folder", ["services/mesh", "services/engines", "services/worker", "bench"])
def test_the_layering_check_sees_imports(folder: str) -> None:
    # Guards the guard: each folder's modules do import things this parser must see.
    assert any(imports_of(p) for p in modules_under(folder))
