"""Imports point one way: services -> worker plumbing -> mesh plumbing; engines stand alone; the test
kit (testkit/) serves tests and bench and leans on neither; bench never leans on tests; services
import none of them; no import circle anywhere in the repository. Read from the source with `ast`,
so a late (function-level) import counts too."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from tests.procs import ROOT

SERVICE_PACKAGES = ("frontend", "processor", "kv_router", "decode_worker", "prefill_worker", "encode_worker", "launch",
                    "planner")
# The KV protocol (block hashing, tiers, KV events) and the worker profiles (the mocker's timing)
# are what engines share with the rest; the settings' one exception (a leaf module, not the mesh's)
# lets engine configs validate themselves as every config does.
ENGINE_MAY_USE = ("services.kv_protocol", "services.profiles", "services.config_error")


def _statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Every statement of a body and the bodies within it (an import is a statement, so this
    finds late ones too, without walking every expression as `ast.walk` would)."""
    for node in body:
        yield node
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            inner = getattr(node, name, None)
            if isinstance(inner, list):
                yield from _statements(inner)


@cache
def import_nodes(path: Path) -> list[ast.Import | ast.ImportFrom]:
    """A file's import statements, read once for every check of the run."""
    tree = ast.parse(path.read_text(), str(path))
    return [node for node in _statements(tree.body) if isinstance(node, (ast.Import, ast.ImportFrom))]


def imports_of(path: Path) -> set[str]:
    found: set[str] = set()
    for node in import_nodes(path):
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
    # Plumbing only: sessions, etcd, discovery, servers, logs. What a request means (routing,
    # outcomes, limits, roles) lives elsewhere.
    forbidden = ("services.engines", "services.worker", "services.routing", "services.contract",
                 *(f"services.{p}" for p in SERVICE_PACKAGES))
    assert offending("services/mesh", forbidden) == []


def test_the_contract_is_a_leaf() -> None:
    assert offending("services/contract", ("services.",), ("services.contract",)) == []


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def import_graph(*folders: str) -> dict[str, set[str]]:
    """Each module's imports of other modules of the trees (`from a.b import c` counts as a.b.c
    where c is a module), late and TYPE_CHECKING imports included."""
    modules = {module_name(p): p for folder in folders for p in modules_under(folder)}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in import_nodes(path):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules}
                found |= {node.module} & modules.keys()
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names} & modules.keys()
        graph[name] = found - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph`: one path around each, found by depth-first search."""
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for dep in sorted(graph.get(name, ())):
            if state.get(dep) == 1:
                found.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        path.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    return found


def python_packages() -> list[str]:
    """Every top-level folder of the repository that holds Python (services, bench, tests, ...)."""
    return sorted(d.name for d in ROOT.iterdir()
                  if d.is_dir() and not d.name.startswith(".") and next(d.rglob("*.py"), None) is not None)


def test_no_import_circle_anywhere_in_the_repository() -> None:
    # Late and TYPE_CHECKING imports count: a circle hidden behind one is still a circle to read.
    # One graph of every package, so a circle through two of them (tests -> testkit -> tests) counts.
    packages = python_packages()
    assert {"services", "testkit", "tests", "bench"} <= set(packages), packages
    assert circles(import_graph(*packages)) == []


def test_the_circle_check_finds_a_circle() -> None:
    # Guards the guard.
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert len(import_graph("services")) > 100
    # Edges between packages are seen: the tests' process layer stands on the test kit.
    assert "testkit.mesh" in import_graph(*python_packages())["tests.procs"]


def test_engines_import_nothing_but_the_kv_protocol_the_profiles_and_the_settings_exception() -> None:
    assert offending("services/engines", ("services.",), ("services.engines", *ENGINE_MAY_USE)) == []


def test_engines_import_nothing_of_the_mesh() -> None:
    # Engines stand alone: not even the mesh's config_error (its exit codes and `die`).
    assert not any(name.startswith("services.mesh") for name in ENGINE_MAY_USE)
    assert offending("services/engines", ("services.mesh",)) == []


def test_the_settings_exception_is_a_leaf() -> None:
    assert imports_of(ROOT / "services/config_error.py") <= {"__future__"}


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


# What one service may take from another: the launcher reads each service's flags to start it.
# Nothing else: what two services share is a library (the router's core, its config and flags
# are services.routing, which the kv-router and a processor with `--routing local` both embed).
SERVICE_MAY_USE = {
    "launch": tuple(f"services.{p}.flags" for p in SERVICE_PACKAGES),
    # A gateway that hosts its processor (--embed-processor) assembles it from the processor's
    # own entry points, its flags and its assembly, and reaches nothing else of it.
    "frontend": ("services.processor.flags", "services.processor.assembly"),
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


def test_services_import_no_test_kit_test_or_benchmark() -> None:
    assert offending("services", ("testkit", "tests", "bench")) == []


def test_the_test_kit_imports_no_test_and_no_benchmark() -> None:
    # Below both: tests/ and bench/ build on it, so it may lean on neither.
    assert offending("testkit", ("tests", "bench")) == []


@pytest.mark.parametrize("folder", ["services/mesh", "services/engines", "services/worker", "bench", "testkit"])
def test_the_layering_check_sees_imports(folder: str) -> None:
    # Guards the guard: each folder's modules do import things this parser must see.
    assert any(imports_of(p) for p in modules_under(folder))
