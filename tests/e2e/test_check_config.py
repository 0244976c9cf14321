"""`--check-config` on every service: exit 0 and print nothing for a good command line, exit 2 with
one line naming the flag for a bad one; start nothing (an etcd that does not exist is fine)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.tools.make_demo_model import ensure_demo_model
from tests.procs import ROOT

NOWHERE = ["--etcd-endpoints", "http://127.0.0.1:1,http://127.0.0.1:2"]
WORKER = ["--engine", "mocker"]
SERVICES = {
    "services.frontend": ["--http-port", "8000", "--metrics-port", "9090", "--log-format", "json"],
    "services.processor": ["--port", "50051", "--metrics-port", "9090"],
    "services.kv_router": ["--router-mode", "kv", "--port", "50051"],
    "services.decode_worker": [*WORKER, "--max-local-prefill-length", "512"],
    "services.prefill_worker": WORKER,
    "services.planner": ["--connector", "none", "--ttft-slo-ms", "300", "--total-workers", "6"],
}
BAD = {
    "services.frontend": (["--max-inflight", "0"], "--max-inflight"),
    "services.processor": (["--migration-limit", "-1"], "--migration-limit"),
    "services.kv_router": (["--router-mode", "psychic"], "--router-mode"),
    "services.decode_worker": ([*WORKER, "--prefill-timeout", "0"], "--prefill-timeout"),
    "services.prefill_worker": ([*WORKER, "--log-format", "xml"], "--log-format"),
    "services.planner": (["--min-prefill-workers", "3", "--max-prefill-workers", "2"], "--min-prefill-workers"),
}
# More than one way a command line can be wrong, for the newer flags.
MORE_BAD = [
    ("services.planner", ["--connector", "local"], "--launcher"),
    ("services.planner", ["--connector", "kubernetes", "--k8s-namespace", "Not_A_Name"], "--k8s-namespace"),
    ("services.decode_worker", [*WORKER, "--start-as", "prefill"], "--switchable"),
    ("services.decode_worker", [*WORKER, "--switchable"], "--kv-transfer nixl"),
    ("services.decode_worker", [*WORKER, "--host-kv-gbps", "0"], "--host-kv-gbps"),
    ("services.kv_router", ["--host-overlap-weight", "1.5"], "--host-overlap-weight"),
    ("services.decode_worker", [*WORKER, "--timing-profile", "/no/such/profile.json"], "--timing-profile"),
    ("services.planner", ["--profile", "tpu-v9"], "--profile: no profile 'tpu-v9'"),
    ("services.planner", ["--profile", "README.md"], "--profile: README.md: not JSON"),
]


def _check(module: str, *argv: str) -> subprocess.CompletedProcess[str]:
    model = str(ensure_demo_model())
    model_flags = [] if module in ("services.frontend", "services.kv_router", "services.planner") else ["--model", model]
    return subprocess.run([sys.executable, "-m", module, *NOWHERE, *model_flags, *argv, "--check-config"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("module", sorted(SERVICES))
def test_a_good_command_line_passes_silently(module: str) -> None:
    done = _check(module, *SERVICES[module])
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


@pytest.mark.parametrize("module, argv, flag", [(m, *BAD[m]) for m in sorted(BAD)] + MORE_BAD)
def test_a_bad_flag_is_named_in_one_line(module: str, argv: list[str], flag: str) -> None:
    done = _check(module, *argv)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("error: ") and flag in done.stderr, done.stderr
