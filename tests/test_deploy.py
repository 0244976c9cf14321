"""The compose file parses, and every container's command is accepted by its service's own flag parser.

Each container's argv goes through the very parser its module's `main` uses (`parser()` of the
frontend, processor and router, `worker_parser(ROLE)` of the workers), with the container's
environment in place, so a renamed or removed flag, a bad value or a wrong module fails here
instead of in a crash-looping container. Importing a package's `__main__` runs nothing: each
guards its `main()` with `if __name__ == "__main__"`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import pytest
import yaml

import services.decode_worker.__main__ as decode_worker_main
import services.frontend.__main__ as frontend_main
import services.kv_router.__main__ as kv_router_main
import services.prefill_worker.__main__ as prefill_worker_main
import services.processor.__main__ as processor_main
from services.decode_worker.flags import disagg_config
from services.frontend.flags import frontend_config
from services.kv_router.flags import router_config
from services.mesh.flags import FlagParser, mesh_config
from services.worker.runtime import worker_parser
from tests.procs import ROOT

PARSERS: dict[str, Callable[[], FlagParser]] = {
    "services.frontend": frontend_main.parser,
    "services.processor": processor_main.parser,
    "services.kv_router": kv_router_main.parser,
    "services.decode_worker": lambda: worker_parser(decode_worker_main.ROLE),
    "services.prefill_worker": lambda: worker_parser(prefill_worker_main.ROLE),
}
MESH_SERVICES = ("frontend", "processor", "kv-router", "decode-worker", "prefill-worker")


def compose_services() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())["services"]


def parse(container: str, spec: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
          extra: list[str] | None = None) -> argparse.Namespace | str:
    """The container's command parsed by its module's parser under the container's environment,
    or the one-line error the parser printed when it refused it."""
    module, *flags = spec["command"]
    assert module in PARSERS, f"{container}: {module} is not a kvmesh service module"
    with monkeypatch.context() as env:
        # Flag defaults read the environment when the parser is built (ETCD_ENDPOINTS, KVMESH_NAMESPACE).
        for key, value in spec.get("environment", {}).items():
            env.setenv(key, str(value))
        capsys.readouterr()
        try:
            return PARSERS[module]().parse_args([*flags, *(extra or [])])
        except SystemExit as exc:
            error = capsys.readouterr().err.strip()
            assert exc.code == 2, f"{container}: exit {exc.code}: {error}"
            return error


def test_compose_defines_the_mesh_on_etcd_with_gpus_for_the_workers() -> None:
    services = compose_services()
    assert {"etcd", *MESH_SERVICES} <= set(services)
    for worker in ("decode-worker", "prefill-worker"):
        assert services[worker]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    for name in MESH_SERVICES:
        assert services[name]["environment"]["ETCD_ENDPOINTS"] == "http://etcd:2379", name
        assert services[name]["depends_on"]["etcd"]["condition"] == "service_healthy", name
    assert services["frontend"]["ports"] == ["8000:8000"]


@pytest.mark.parametrize("container", MESH_SERVICES)
def test_every_container_command_is_accepted_by_its_services_parser(
        container: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(container, compose_services()[container], monkeypatch, capsys)
    if isinstance(args, str):
        pytest.fail(f"{container}: its command is refused: {args}")
    # The mesh settings every service builds first: etcd from the container's environment.
    mesh = mesh_config(args)
    assert mesh.etcd_endpoints == ("http://etcd:2379",) and mesh.namespace == "kvmesh"
    assert mesh.host == "0.0.0.0", f"{container} must listen on all interfaces inside its container"


def test_the_parsed_commands_mean_what_the_deployment_intends(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    services = compose_services()
    parsed = {name: parse(name, services[name], monkeypatch, capsys) for name in MESH_SERVICES}
    assert not any(isinstance(a, str) for a in parsed.values()), parsed
    assert router_config(parsed["kv-router"]).mode == "kv"
    assert parsed["frontend"].http_port == 8000 and frontend_config(parsed["frontend"]).api_key is None
    for worker in ("decode-worker", "prefill-worker"):
        assert (parsed[worker].engine, parsed[worker].model, parsed[worker].kv_transfer) == ("vllm", "/model", "nixl")
    decode = parsed["decode-worker"]
    disagg = disagg_config(decode, kv_transfer=decode.kv_transfer == "nixl")
    assert disagg.remote_prefill and disagg.conditional_disagg
    assert (disagg.max_local_prefill_length, disagg.max_prefill_queue_size) == (512, 2)


@pytest.mark.parametrize("container", MESH_SERVICES)
def test_a_made_up_flag_is_refused_by_each_services_parser(
        container: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    error = parse(container, compose_services()[container], monkeypatch, capsys, ["--made-up-flag", "1"])
    assert isinstance(error, str), f"{container}: the parser accepted --made-up-flag"
    assert error.startswith("error: ") and "unrecognized arguments: --made-up-flag 1" in error, error


def test_a_bad_flag_value_is_refused_too(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    spec = {"command": ["services.kv_router", "--host", "0.0.0.0", "--router-mode", "fastest"]}
    error = parse("kv-router", spec, monkeypatch, capsys)
    assert isinstance(error, str) and "argument --router-mode: invalid choice: 'fastest'" in error, error
