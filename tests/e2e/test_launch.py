"""The launcher: YAML worker-config files, start-up failures, clean shutdown."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import httpx
import pytest

from services.launch.config import load
from tests.procs import Etcd, Proc, free_port, service, wait_until


def test_a_yaml_worker_config_sets_defaults_and_flags_win(tmp_path: Path) -> None:
    cfg_file = tmp_path / "mesh.yaml"
    cfg_file.write_text(
        "VllmWorker:\n  model: /models/x\n  enable-prefix-caching: true\n  router: round-robin\n"
        "  remote-prefill: true\n  conditional-disagg: false\n  max-local-prefill-length: 1000\n"
        "ServiceArgs:\n  workers: 3\nengine: mocker\n")
    cfg = load(["--config", str(cfg_file), "--max-local-prefill-length", "64"])
    assert cfg.model == "/models/x"
    assert cfg.decode_workers == 3
    assert cfg.engine == "mocker"
    # What the children are given: the file's settings, except where a flag overrides them.
    assert _flag(cfg.router_argv, "--router-mode") == "round-robin"
    assert "--no-conditional-disagg" in cfg.disagg_argv
    assert _flag(cfg.disagg_argv, "--max-local-prefill-length") == "64"
    assert _flag(cfg.engine_argv, "--engine") == "mocker"


def _flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_unknown_yaml_setting_is_refused(tmp_path: Path) -> None:
    cfg_file = tmp_path / "bad.yaml"
    cfg_file.write_text("routr: kv\n")
    with pytest.raises(SystemExit) as exc:
        load(["--config", str(cfg_file)])
    assert exc.value.code == 2


def test_a_child_dying_at_start_up_fails_the_launch_with_its_reason(tmp_path: Path) -> None:
    launcher = service("services.launch", "--engine", "mocker", "--model", str(tmp_path / "missing"),
                       "--http-port", str(free_port()), "--prefill-workers", "0")
    code = launcher.popen.wait(120)
    launcher.stop()
    assert code == 1
    out = launcher.tail(200)
    assert "exited with code 2 during start-up" in out
    assert "no config.json" in out
    # Nothing it started is left running: the start-up failure tore everything down.
    pids = [int(line.split("pid=")[1]) for line in launcher.lines if line.startswith("CHILD ")]
    assert "etcd" in {line.split()[1] for line in launcher.lines if line.startswith("CHILD ")}
    assert all(not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
               for pid in pids)


def test_launch_starts_embedded_etcd_and_stops_every_child_on_sigterm() -> None:
    port = free_port()
    launcher = service("services.launch", "--engine", "mocker", "--http-port", str(port), "--prefill-workers", "0",
                       "--decode-workers", "2")
    launcher.wait_for(rf"^READY http://127.0.0.1:{port}/v1$", 120)
    children = [line.split()[1] for line in launcher.lines if line.startswith("CHILD ")]
    assert children == ["etcd", "kv-router", "processor", "decode-worker", "frontend"]
    pids = [int(line.split("pid=")[1]) for line in launcher.lines if line.startswith("CHILD ")]
    launcher.popen.send_signal(signal.SIGTERM)
    assert launcher.popen.wait(60) == 0
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    # The front door closes first; then the rest stop together, named on one line.
    stops = [line for line in launcher.lines if line.startswith("stopping ")]
    assert len(stops) == 2 and re.fullmatch(r"stopping frontend pid=\d+", stops[0]), stops
    assert [part.split()[0] for part in stops[1].removeprefix("stopping ").split(", ")] == \
        ["kv-router", "processor", "decode-worker"], stops


def test_launch_joins_an_existing_etcd_without_starting_one(etcd: Etcd) -> None:
    port = free_port()
    launcher = service("services.launch", "--engine", "mocker", "--http-port", str(port), "--prefill-workers", "0",
                       "--etcd-endpoints", etcd.endpoint, "--namespace", "launch-join")
    try:
        launcher.wait_for(r"^READY ", 120)
        assert not any(line.startswith("CHILD etcd") for line in launcher.lines)
    finally:
        assert launcher.stop() == 0


def _child_pids(launcher: Proc, component: str) -> list[int]:
    return [int(line.split("pid=")[1]) for line in launcher.lines if line.startswith(f"CHILD {component} ")]


def test_a_child_that_dies_after_start_up_is_restarted_and_serves_again(etcd: Etcd, tmp_path: Path) -> None:
    port = free_port()
    launcher = service("services.launch", "--engine", "mocker", "--http-port", str(port), "--prefill-workers", "0",
                       "--etcd-endpoints", etcd.endpoint, "--namespace", "launch-restart", "--run-dir", str(tmp_path))
    try:
        launcher.wait_for(r"^READY ", 120)
        (first,) = _child_pids(launcher, "decode-worker")
        os.kill(first, signal.SIGKILL)
        launcher.wait_for(rf"decode-worker pid={first} exited with code -9; restarting it in 1s", 30)
        second = int(launcher.wait_for(rf"^CHILD decode-worker pid=(?!{first}\b)(\d+)$", 30).group(1))
        launcher.wait_for(rf"^ready  decode-worker +pid={second} ", 30)
        assert wait_until(lambda: _completes(port), 60)
        # The restarted worker appends to the same log file, after a header of its own.
        log = (tmp_path / "decode-worker.log").read_text()
        assert [int(pid) for pid in re.findall(r"^---- .* decode-worker started pid=(\d+):", log, re.M)] == [first, second]
        assert log.count("decode-worker ready: ") == 2
    finally:
        assert launcher.stop() == 0, launcher.tail()


def test_with_on_child_exit_exit_a_dead_child_stops_the_mesh_with_status_1(etcd: Etcd) -> None:
    port = free_port()
    launcher = service("services.launch", "--engine", "mocker", "--http-port", str(port), "--prefill-workers", "0",
                       "--etcd-endpoints", etcd.endpoint, "--namespace", "launch-exit", "--on-child-exit", "exit")
    launcher.wait_for(r"^READY ", 120)
    pids = {c: _child_pids(launcher, c) for c in ("kv-router", "processor", "decode-worker", "frontend")}
    os.kill(pids["processor"][0], signal.SIGKILL)
    assert launcher.popen.wait(60) == 1
    assert any("processor pid=" in line and "stopping the mesh (--on-child-exit exit)" in line
               for line in launcher.lines), launcher.tail()
    for pid in (p for ps in pids.values() for p in ps):
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    launcher.stop()


def _completes(port: int) -> bool:
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=10,
                       json={"model": "kvmesh-demo", "prompt": "back?", "max_tokens": 2})
    except httpx.HTTPError:
        return False
    return r.status_code == 200
