"""The launcher's quiet console: CHILD, ready and READY lines, warnings and errors, and every
child's full output in a run directory; `--verbose` shows everything; `--check-config` starts
nothing."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

import httpx
import pytest

from services.launch.children import Child
from services.launch.console import Console
from services.launch.output_filter import MAX_LINE_BYTES, parse
from services.launch.run_dir import KEEP_RUNS, create_run_dir, log_names
from testkit.proc_stat import argv as proc_argv
from tests.certs import Authority
from tests.procs import Etcd, Proc, free_port, service

# What the console may show before READY when nothing goes wrong.
QUIET_LINE = re.compile(r"^(LOGS /\S+|CHILD [a-z-]+ pid=\d+|ready  [a-z-]+ +pid=\d+ +\(\d+\.\d+s\)|READY http://\S+)$")

# -- a real child: console and log file ---------------------------------------------------------

CHATTY_CHILD = f"""
import logging, sys
logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s fake %(name)s: %(message)s")
log = logging.getLogger("fake")
log.info("hello from the child")
print("x" * {3 * MAX_LINE_BYTES})
log.warning("a warning the user should see")
print("fake ready: abc", flush=True)
raise RuntimeError("the child died")
"""


def test_a_child_writes_everything_to_its_log_file_and_only_what_matters_to_the_console(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "fake.log"

    async def run() -> Child:
        child = Child("fake", [sys.executable, "-c", CHATTY_CHILD], ready_when=re.compile("^fake ready: "),
                      log_path=log, console=Console())
        await child.start()
        assert await asyncio.wait_for(child.wait(), 30) == 1
        return child

    child = asyncio.run(run())
    out, err = capsys.readouterr()
    pid = child.process.pid if child.process else 0
    assert out.splitlines()[0] == f"CHILD fake pid={pid}"
    assert re.fullmatch(rf"ready  fake +pid={pid} +\(\d+\.\ds\)", out.splitlines()[1])
    shown = err.splitlines()
    assert all(line.startswith(f"[fake {pid}] ") for line in shown)
    assert any("WARNING fake fake: a warning the user should see" in line for line in shown)
    assert any(line.endswith("Traceback (most recent call last):") for line in shown)
    assert shown[-1] == f"[fake {pid}] RuntimeError: the child died"
    assert not any("hello from the child" in line or "xxxx" in line for line in shown)
    # The file has every byte, the 192 KiB line included (more than a readline() could take).
    text = log.read_text()
    assert "hello from the child" in text and "x" * (3 * MAX_LINE_BYTES) + "\n" in text
    assert text.startswith("---- ") and f"fake started pid={pid}" in text.splitlines()[0]


# -- the launcher --------------------------------------------------------------------------------

def _before_ready(launcher: Proc) -> list[str]:
    lines = launcher.tail(10_000).splitlines()
    return lines[:next(i for i, line in enumerate(lines) if line.startswith("READY ")) + 1]


def _child_pids(launcher: Proc) -> dict[int, str]:
    return {int(line.split("pid=")[1]): line.split()[1] for line in launcher.lines if line.startswith("CHILD ")}


def _all_gone(pids: Iterable[int]) -> bool:
    return all(not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
               for pid in pids)


def test_the_console_shows_only_child_ready_and_ready_lines_and_the_run_dir_has_every_childs_output() -> None:
    port = free_port()
    launcher = service("services.launch", "--engine", "mocker", "--http-port", str(port), "--prefill-workers", "1")
    try:
        launcher.wait_for(rf"^READY http://127.0.0.1:{port}/v1$", 120)
        console = _before_ready(launcher)
        assert all(QUIET_LINE.match(line) for line in console), "\n".join(console)
        children = _child_pids(launcher)
        assert sorted(children.values()) == ["decode-worker", "etcd", "frontend", "kv-router", "prefill-worker",
                                             "processor"]
        ready = {int(m.group(1)) for line in console if (m := re.match(r"ready  \S+ +pid=(\d+)", line))}
        assert ready == set(children)
        (run_dir,) = [Path(line.split(" ", 1)[1]) for line in console if line.startswith("LOGS ")]
        assert console[0].startswith("LOGS ") and run_dir.is_dir()
        assert (run_dir.parent / "latest").resolve() == run_dir
        files = {p.name: p.read_text() for p in run_dir.iterdir()}
        assert set(files) == {"etcd.log", "kv-router.log", "processor.log", "decode-worker.log", "prefill-worker.log",
                              "frontend.log", "launch.log"}
        assert re.search(r" INFO kv-router kv_router: router \w+ \(kv mode\) at ", files["kv-router.log"])
        assert re.search(r" INFO processor processor: processor \w+ for ", files["processor.log"])
        assert "decode-worker ready: " in files["decode-worker.log"]
        assert "prefill-worker ready: " in files["prefill-worker.log"]
        assert re.search(r" INFO frontend frontend: frontend \w+ listening on ", files["frontend.log"])
        assert f"READY http://127.0.0.1:{port}/v1" in files["launch.log"]
    finally:
        assert launcher.stop(30) == 0, launcher.tail()
    # SIGTERM stopped every child.
    assert _all_gone(children)


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_an_error_a_child_logs_reaches_the_console(etcd: Etcd, log_format: str, tmp_path: Path) -> None:
    namespace = f"console-{log_format}-{uuid.uuid4().hex[:6]}"
    launcher = service("services.launch", "--engine", "mocker", "--http-port", str(free_port()), "--prefill-workers",
                       "0", "--etcd-endpoints", etcd.endpoint, "--namespace", namespace, "--log-format", log_format,
                       "--run-dir", str(tmp_path))
    odd = None
    try:
        launcher.wait_for(r"^READY ", 120)
        assert len([line for line in _before_ready(launcher) if line.startswith("ready  ")]) == 4
        (router_pid,) = [pid for pid, c in _child_pids(launcher).items() if c == "kv-router"]
        # A worker whose block size differs from the mesh's: the router refuses it with an ERROR line.
        odd = service("services.decode_worker", "--etcd-endpoints", etcd.endpoint, "--namespace", namespace,
                      "--engine", "mocker", "--block-size", "32", name="odd-worker")
        line = launcher.wait_for(rf"^\[kv-router {router_pid}\] .*has block size 32", 60).string
        assert '"level": "ERROR"' in line if log_format == "json" else " ERROR kv-router " in line
        child_lines = [line.split("] ", 1)[1] for line in launcher.lines if line.startswith("[")]
        assert not any(parse(text).level == logging.INFO for text in child_lines), launcher.tail()
        if log_format == "json":
            first = (tmp_path / "kv-router.log").read_text().splitlines()[1]
            assert json.loads(first)["component"] == "kv-router"
    finally:
        if odd is not None:
            odd.stop()
        assert launcher.stop(30) == 0, launcher.tail()


def test_verbose_shows_every_childs_info_lines_and_still_writes_the_files(etcd: Etcd, tmp_path: Path) -> None:
    launcher = service("services.launch", "--engine", "mocker", "--http-port", str(free_port()), "--prefill-workers",
                       "0", "--etcd-endpoints", etcd.endpoint, "--namespace", f"verbose-{uuid.uuid4().hex[:6]}",
                       "--verbose", "--run-dir", str(tmp_path))
    try:
        launcher.wait_for(r"^READY ", 120)
        pids = {c: pid for pid, c in _child_pids(launcher).items()}
        assert any(re.match(rf"\[kv-router {pids['kv-router']}\] .* INFO kv-router kv_router: router ", line)
                   for line in launcher.lines), launcher.tail()
        assert any(line == f"[decode-worker {pids['decode-worker']}] decode-worker ready: " + line.split(": ")[-1]
                   for line in launcher.lines)
        assert "router " in (tmp_path / "kv-router.log").read_text()
    finally:
        assert launcher.stop(30) == 0, launcher.tail()


def test_check_config_with_a_bad_child_flag_exits_2_with_one_line_and_starts_nothing(tmp_path: Path) -> None:
    launcher = service("services.launch", "--engine", "mocker", "--check-config", "--model", str(tmp_path / "none"),
                       "--run-dir", str(tmp_path / "run"))
    assert launcher.popen.wait(60) == 2
    launcher.stop()
    assert launcher.lines == [f"error: processor: --model {tmp_path / 'none'}: no config.json there "
                              "(expected a Hugging Face model directory)"]
    assert not (tmp_path / "run").exists()


def test_check_config_with_bad_tls_files_exits_2_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "c.pem").write_text("not a certificate")
    launcher = service("services.launch", "--check-config", "--tls-cert", str(tmp_path / "c.pem"),
                       "--tls-key", str(tmp_path / "c.pem"), "--tls-ca", str(tmp_path / "c.pem"))
    assert launcher.popen.wait(60) == 2
    launcher.stop()
    assert launcher.lines == [f"error: --tls-cert {tmp_path / 'c.pem'}: not a PEM file"]


def test_check_config_with_good_flags_exits_0_quickly_printing_and_starting_nothing(tmp_path: Path) -> None:
    started = time.monotonic()
    launcher = service("services.launch", "--engine", "mocker", "--check-config", "--prefill-workers", "1",
                       "--routers", "2", "--log-format", "json", "--run-dir", str(tmp_path / "run"))
    assert launcher.popen.wait(60) == 0
    launcher.stop()
    assert launcher.lines == []
    assert time.monotonic() - started < 60
    assert not (tmp_path / "run").exists()


def test_tls_files_and_reflection_reach_every_child_and_health_is_polled_on_the_metrics_port(tmp_path: Path) -> None:
    certs = Authority(tmp_path / "ca").issue("mesh")
    port, metrics_port = free_port(), free_port()
    launcher = service("services.launch", "--engine", "mocker", "--http-port", str(port), "--prefill-workers", "0",
                       "--metrics-port", str(metrics_port), *certs.flags(), "--run-dir", str(tmp_path / "run"))
    try:
        launcher.wait_for(rf"^READY http://127.0.0.1:{port}/v1$", 120)
        assert httpx.get(f"http://127.0.0.1:{metrics_port}/health", timeout=10).status_code == 200
        for pid, component in _child_pids(launcher).items():
            if component == "etcd":
                continue
            argv = proc_argv(pid)
            assert "--grpc-reflection" in argv and argv[argv.index("--tls-ca") + 1] == str(certs.ca), component
        # Every gRPC hop of this answer was mutual TLS (the children accept nothing else).
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                           json={"model": "kvmesh-demo", "prompt": "over tls", "max_tokens": 2})
        assert reply.status_code == 200, reply.text
    finally:
        assert launcher.stop(30) == 0, launcher.tail()


# -- the run directory ----------------------------------------------------------------------------

def test_log_files_are_named_after_components_and_replicas_are_numbered() -> None:
    assert log_names(["kv-router", "processor", "processor", "decode-worker", "frontend"]) == [
        "kv-router.log", "processor-1.log", "processor-2.log", "decode-worker.log", "frontend.log"]


def test_a_new_run_dir_is_made_under_cache_runs_and_old_runs_of_dead_launchers_are_pruned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    runs = tmp_path / ".cache" / "runs"
    dead = [runs / f"2000010{i // 10}-0000{i % 10}0-999999999" for i in range(KEEP_RUNS + 5)]
    alive = runs / f"19990101-000000-{os.getpid()}"  # older than all, but its launcher still runs
    mine = runs / "notes"
    for d in [*dead, alive, mine]:
        d.mkdir(parents=True)
    new = create_run_dir()
    assert new.parent == runs and new.name.endswith(f"-{os.getpid()}")
    assert (runs / "latest").resolve() == new
    left = {p.name for p in runs.iterdir()}
    assert left == {new.name, alive.name, mine.name, "latest"} | {d.name for d in sorted(dead)[-(KEEP_RUNS - 1):]}
