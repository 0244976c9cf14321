"""The compose file parses and every container runs a module that exists with the flags it is given."""

from __future__ import annotations

import subprocess
import sys

import yaml

from tests.procs import ROOT


def test_compose_file_runs_every_service_with_valid_flags() -> None:
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"etcd", "frontend", "processor", "kv-router", "decode-worker", "prefill-worker"} <= set(services)
    assert services["decode-worker"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    for name, spec in services.items():
        if name == "etcd":
            continue
        module, *flags = spec["command"]
        # Parsing the flags is enough: --help exits 0 only after argparse accepted the module.
        result = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stderr
        for flag in (f for f in flags if f.startswith("--")):
            assert flag in result.stdout, f"{name}: {module} has no {flag}"
        assert spec["environment"]["ETCD_ENDPOINTS"] == "http://etcd:2379"
