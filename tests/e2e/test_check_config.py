"""`--check-config` on every service: exit 0 and print nothing for a good command line, exit 2 with
one line naming the flag for a bad one; start nothing (an etcd that does not exist is fine).

Each service's good command line runs as a real process (`python -m`: nothing printed, not even
an import's warning); the refusals run in this process through the same `main(argv)`, since a
new interpreter per bad flag only repeats the imports."""

from __future__ import annotations

import importlib
import logging
import subprocess
import sys
from collections.abc import Callable, Iterator

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
    ("services.decode_worker", ["--engine", "vllm", "--answer-tokens", "5"], "--answer-tokens"),
    ("services.kv_router", ["--host-overlap-weight", "1.5"], "--host-overlap-weight"),
    ("services.decode_worker", [*WORKER, "--timing-profile", "/no/such/profile.json"], "--timing-profile"),
    ("services.planner", ["--profile", "tpu-v9"], "--profile: no profile 'tpu-v9'"),
    ("services.planner", ["--profile", "README.md"], "--profile: README.md: not JSON"),
    ("services.frontend", ["--model", "/some/model"], "--embed-processor"),
    ("services.frontend", ["--embed-processor", "--default-max-tokens", "0"], "--default-max-tokens"),
]


def _argv(module: str, *argv: str) -> list[str]:
    model = str(ensure_demo_model())
    model_flags = [] if module in ("services.frontend", "services.kv_router", "services.planner") else ["--model", model]
    return [*NOWHERE, *model_flags, *argv, "--check-config"]


def _main(module: str) -> Callable[[list[str]], None]:
    """The service's `main`, as `python -m module` runs it, taking the command line."""
    entry = importlib.import_module(f"{module}.__main__")
    role = getattr(entry, "ROLE", None)  # the workers: one main for every role
    return (lambda argv: entry.main(role, argv)) if role is not None else entry.main


@pytest.fixture
def own_logging() -> Iterator[None]:
    """A service's main sets up the process's logging: put pytest's back afterwards."""
    from services.mesh.logs import QUIET_LOGGERS

    root, quiet = logging.getLogger(), [logging.getLogger(name) for name in QUIET_LOGGERS]
    handlers, level, levels = root.handlers[:], root.level, [logger.level for logger in quiet]
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for logger, was in zip(quiet, levels, strict=True):
        logger.setLevel(was)


@pytest.mark.parametrize("module", sorted(SERVICES))
def test_a_good_command_line_passes_silently(module: str) -> None:
    done = subprocess.run([sys.executable, "-m", module, *_argv(module, *SERVICES[module])],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


@pytest.mark.parametrize("module, argv, flag", [(m, *BAD[m]) for m in sorted(BAD)] + MORE_BAD)
def test_a_bad_flag_is_named_in_one_line(module: str, argv: list[str], flag: str, own_logging: None,
                                         capfd: pytest.CaptureFixture[str]) -> None:
    main = _main(module)
    capfd.readouterr()  # what importing it printed is the good command line's business
    with pytest.raises(SystemExit) as exit_:
        main(_argv(module, *argv))
    out, err = capfd.readouterr()
    assert exit_.value.code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and flag in err, err
