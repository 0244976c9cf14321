"""`python -m services.planner profile` against a real mocker worker in a launched mesh: the
profile it writes recovers the timing the worker runs, within what a measurement through gRPC
allows; a mesh started on that file (mocker `--timing-profile`, planner `--profile`) serves."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from services.profiles.profile_file import load_profile
from tests.procs import MODEL, ROOT, Etcd, Mesh
from testkit.proc_stat import argv as proc_argv

# A small sweep: enough points for the fit, a few seconds of a worker's time.
SWEEP = ("--prompt-lengths", "128,512,1024,2048", "--repeats", "2", "--batch-sizes", "1,8,32",
         "--contexts", "128", "--decode-tokens", "24")


def test_a_profile_measured_on_a_worker_recovers_its_timing(etcd: Etcd, tmp_path: Path) -> None:
    namespace = f"prof-{uuid.uuid4().hex[:6]}"
    mesh = Mesh.launch(etcd.endpoint, namespace, "mocker", "--prefill-workers", "0", "--decode-workers", "1")
    out = tmp_path / "profile.json"
    try:
        done = subprocess.run([sys.executable, "-m", "services.planner", "profile", "--etcd-endpoints", etcd.endpoint,
                               "--namespace", namespace, "--out", str(out), *SWEEP],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        assert mesh.stop() == 0
    assert done.returncode == 0, done.stderr[-2000:]
    assert "prefill   2048 tokens" in done.stdout and f"wrote {out}" in done.stdout
    measured, truth = load_profile(str(out)), load_profile("h100-8b")  # the mocker's default timing
    assert (measured.engine, measured.model, measured.block_size) == ("mocker", MODEL, 16)
    assert len(measured.prefill_points) == 4 and len(measured.decode_points) == 3
    # What a prompt and a step cost where they matter; the mesh's own few ms sit in the bases.
    for n in (512, 2048):
        assert measured.cost.prefill_s(n) == pytest.approx(truth.cost.prefill_s(n), rel=0.25)
    for batch in (1, 32):
        assert measured.cost.decode_step_s(batch, 0) == pytest.approx(truth.cost.decode_step_s(batch, 0), rel=0.25)
    assert measured.fit_error["prefill"] < 0.1 and measured.fit_error["decode"] < 0.1


def test_no_worker_to_measure_is_a_clear_error(etcd: Etcd, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "services.planner", "profile", "--etcd-endpoints", etcd.endpoint,
                           "--namespace", f"empty-{uuid.uuid4().hex[:6]}", "--out", str(tmp_path / "p.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "no worker registered" in done.stderr
    assert not (tmp_path / "p.json").exists()


def test_a_mesh_runs_and_plans_on_a_profile_file(etcd: Etcd, tmp_path: Path) -> None:
    profile = tmp_path / "measured.json"
    profile.write_text(load_profile("large-gpu-8b").scaled(2.0, "a slower machine").to_json())
    mesh = Mesh.launch(etcd.endpoint, f"profrun-{uuid.uuid4().hex[:6]}", "mocker", "--timing-profile", str(profile),
                       "--planner", "none", "--adjustment-interval", "1", "--speedup", "1")
    try:
        r = httpx.post(f"{mesh.base_url}/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200, r.text
        children = {line.split()[1]: int(line.split("pid=")[1]) for line in mesh.launcher.lines
                    if line.startswith("CHILD ")}
        argv = proc_argv(children["planner"])
        # The planner predicts from the mocker's own profile, at the mocker's speedup (1 here).
        assert argv[argv.index("--profile") + 1] == str(profile)
        assert float(argv[argv.index("--profile-speedup") + 1]) == 1.0
    finally:
        assert mesh.stop() == 0
