"""The short form of `make chaos`: a disaggregated mocker mesh under streaming load while a decode
worker, a prefill worker, a processor and a router are SIGKILLed and replaced, a decode worker is
rolled, and etcd is down for 12 s. Every request must complete with exactly the text the healthy
mesh gives for it, and nothing of the run may be left running (bench/chaos/ says how)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from bench.chaos.faults import FAULT_KINDS, OUTAGE, plan
from bench.chaos.load import Outcome, difference

ROOT = Path(__file__).resolve().parents[2]

# The quick form takes about 75 s on 2 cores; the margin covers a slow machine, not a hung run.
LIMIT_S = 300


def test_the_quick_chaos_run_loses_and_corrupts_nothing() -> None:
    timeout = shutil.which("timeout")
    assert timeout is not None, "coreutils' timeout is needed to bound the run"
    run = subprocess.run([timeout, "--kill-after=15", str(LIMIT_S), sys.executable, "-m", "bench.chaos", "--quick",
                          "--seed", "1"], cwd=ROOT, capture_output=True, text=True)
    output = run.stdout + run.stderr
    assert run.returncode != 124, f"the chaos run overran {LIMIT_S}s:\n{output[-6000:]}"
    row = re.search(r"^\| *sent \| *completed \|.*\n\|[-|]+\|\n\| *(\d+) \| *(\d+) \|", output, re.MULTILINE)
    assert row is not None, f"no summary table:\n{output[-6000:]}"
    assert int(row.group(2)) > 0, output[-6000:]
    line = re.search(r"^CHAOS_RESULT (.+)$", output, re.MULTILINE)
    assert line is not None, f"no result line:\n{output[-6000:]}"
    result = json.loads(line.group(1))
    assert run.returncode == 0, f"{result['reasons']}:\n{output[-8000:]}"
    assert result["failed"] == 0 and result["corrupted"] == 0


def test_the_fault_plan_is_a_function_of_the_seed_and_fits_the_load_window() -> None:
    faults = plan(1, 40, 12)
    assert [(f.kind, f.planned_s) for f in faults] == [(f.kind, f.planned_s) for f in plan(1, 40, 12)]
    assert sorted(f.kind for f in faults) == sorted(FAULT_KINDS)
    times = [f.planned_s for f in faults]
    assert times == sorted(times) and 4 <= times[0] and times[-1] <= 34
    outage = next(i for i, f in enumerate(faults) if f.kind == OUTAGE)
    if outage + 1 < len(faults):
        assert times[outage + 1] - times[outage] >= 12


def test_a_stream_that_differs_from_the_reference_is_caught() -> None:
    want = Outcome(0, 0.0, text="abcdef", finish="length", completion_tokens=6)
    assert difference(Outcome(0, 1.0, text="abcdef", finish="length", completion_tokens=6), want, 6) is None
    assert "char 3" in (difference(Outcome(0, 1.0, text="abcXef", finish="length", completion_tokens=6), want, 6) or "")
    assert difference(Outcome(0, 1.0, text="abcdef", finish="length", completion_tokens=5), want, 6) is not None
    assert difference(Outcome(0, 1.0, text="abcdef", finish="stop", completion_tokens=6), want, 6) is not None
