"""The planner benchmark's profiles: one measured on a worker like the benchmark's, and the same
made 2x off on purpose.

The measured one comes from `python -m services.planner profile` run against a one-worker mocker
mesh with the benchmark's timing and speedup, as a user would profile a worker before deploying;
the 2x-off one says every step takes half as long as it does, so the planner's calibration has
to find the factor itself.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from testkit.mesh import launched_mesh
from bench.planner.split import etcd_endpoint
from services.profiles.profile_file import WorkerProfile, load_profile, save_profile

PROFILE_NAMESPACE = "bench-planner-profile"
# The benchmark's prompts are 64 and 512 tokens, its batches up to ~50 sequences per worker.
SWEEP = ("--prompt-lengths", "64,128,256,512,1024", "--batch-sizes", "1,4,16,48", "--contexts", "64,512",
         "--repeats", "3")
PROFILE_TIMEOUT_S = 600


def measured_profile(engine_flags: tuple[str, ...], out: Path) -> WorkerProfile:
    """Profiles one decode worker started with `engine_flags`; writes and returns the profile."""
    print("planner: profiling one worker (python -m services.planner profile) ...", flush=True)
    started = time.monotonic()
    with launched_mesh(*engine_flags, "--prefill-workers", "0", "--decode-workers", "1",
                       "--namespace", PROFILE_NAMESPACE) as mesh:
        endpoint = etcd_endpoint(mesh.pids("etcd")[0])
        done = subprocess.run([sys.executable, "-m", "services.planner", "profile", "--etcd-endpoints", endpoint,
                               "--namespace", PROFILE_NAMESPACE, "--out", str(out), *SWEEP],
                              timeout=PROFILE_TIMEOUT_S, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"profiling failed ({done.returncode}): {done.stderr.strip()[-600:]}")
    print(done.stdout.strip().splitlines()[-1], flush=True)
    print(f"planner: profiled in {time.monotonic() - started:.0f}s", flush=True)
    return load_profile(str(out))


def off_by(profile: WorkerProfile, factor: float, out: Path) -> Path:
    save_profile(profile.scaled(factor, f"scaled by {factor:g} on purpose (the planner benchmark)"), out)
    return out
