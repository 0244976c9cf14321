"""Imports point one way: services -> worker plumbing -> mesh plumbing; engines stand alone; bench
never leans on tests. Read from the source with `ast`, so a late (function-level) import counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.procs import ROOT

SERVICE_PACKAGES = ("frontend", "processor", "kv_router", "decode_worker", "prefill_worker", "launch", "planner")
# The KV protocol (block hashing, tiers, KV events) and the worker profiles (the mocker's timing)
# are what engines share with the rest.
ENGINE_MAY_USE = ("services.kv_protocol", "services.profiles")


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


def test_engines_import_nothing_of_the_mesh_but_the_kv_protocol() -> None:
    assert offending("services/engines", ("services.",), ("services.engines", *ENGINE_MAY_USE)) == []


def test_the_kv_protocol_is_a_leaf() -> None:
    assert offending("services/kv_protocol", ("services.",), ("services.kv_protocol",)) == []


def test_the_profiles_are_a_leaf() -> None:
    assert offending("services/profiles", ("services.",), ("services.profiles",)) == []


def test_the_planner_predicts_from_profiles_not_from_an_engine() -> None:
    """Its predictions come from a profile file; the mocker's timing is one more reader of it."""
    assert offending("services/planner", ("services.engines",)) == []


def test_no_engine_reaches_into_the_mocker() -> None:
    outside = [p for p in modules_under("services/engines") if "mocker" not in p.relative_to(ROOT).parts]
    assert outside, "no engine modules found beside the mocker"
    assert [f"{p.relative_to(ROOT)} imports {name}" for p in outside for name in sorted(imports_of(p))
            if name.startswith("services.engines.mocker")] == []


# What one service may take from another: the launcher reads each service's flags to start it,
# and a processor with `--routing local` offers the router's flags (the router's core itself is
# the services.routing library, which both embed).
SERVICE_MAY_USE = {
    "launch": tuple(f"services.{p}.flags" for p in SERVICE_PACKAGES),
    "processor": ("services.kv_router.flags",),
}


def test_the_routing_library_imports_no_service() -> None:
    assert offending("services/routing", tuple(f"services.{p}" for p in SERVICE_PACKAGES)) == []


@pytest.mark.parametrize("package", SERVICE_PACKAGES)
def test_no_service_reaches_into_another(package: str) -> None:
    others = tuple(f"services.{p}" for p in SERVICE_PACKAGES if p != package)
    assert offending(f"services/{package}", others, SERVICE_MAY_USE.get(package, ())) == []


def test_the_worker_package_imports_no_service() -> None:
    assert offending("services/worker", tuple(f"services.{p}" for p in SERVICE_PACKAGES)) == []


def test_benchmarks_never_import_the_tests() -> None:
    assert offending("bench", ("tests",)) == []


@pytest.mark.parametrize("folder", ["services/mesh", "services/engines", "services/worker", "bench"])
def test_the_layering_check_sees_imports(folder: str) -> None:
    # Guards the guard: each folder's modules do import things this parser must see.
    assert any(imports_of(p) for p in modules_under(folder))
