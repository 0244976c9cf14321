"""Everything in deploy/, checked offline: the image, the compose file, the Kubernetes manifests.

There is no Docker engine and no Kubernetes cluster on these machines, so nothing is deployed
here. Instead: every Kubernetes manifest, and every kustomization as `kubectl kustomize` renders
it, validates against the Kubernetes schemas (`kubernetes-validate`, strict: unknown fields
fail); every container command, in compose and in each rendered overlay, is run through its own
service's `--check-config` as a real process, under the container's environment and with
container-only paths replaced by local stand-ins (the demo model for the model volume, test
certificates and keys for mounted Secrets, 127.0.0.1 for the pod IP); and ports, probes,
Services and the environment agree between compose, Kubernetes and docs/reference.md.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from services.mesh.flags import mesh_config
from services.tools.make_demo_model import ensure_demo_model
from tests.certs import Authority
from tests.procs import ROOT

from tests.deploy_files import (
    Container,
    DEPLOY,
    FRONTEND_PORT,
    K8S,
    MESH_SERVICES,
    NAMESPACE,
    WORKERS,
    all_containers,
    compose_containers,
    compose_services,
    container,
    dockerfile_entrypoint,
    load_all,
    parse,
)


# -- --check-config as a real process ----------------------------------------------------------------

@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Local directories for what a container mounts: the demo model, and each example Secret's
    keys as files (certificates from a test CA, other keys as text)."""
    root = tmp_path_factory.mktemp("mounts")
    issued = Authority(root / "ca").issue("kvmesh")
    pem = {"ca.crt": issued.ca, "tls.crt": issued.cert, "tls.key": issued.key}
    dirs = {"model": ensure_demo_model(), "scratch": root / "scratch"}
    dirs["scratch"].mkdir()
    for secret in load_all(K8S / "examples" / "secrets.yaml"):
        d = dirs[f"secret:{secret['metadata']['name']}"] = root / secret["metadata"]["name"]
        d.mkdir()
        for key in secret["stringData"]:
            (d / key).write_bytes(pem[key].read_bytes() if key in pem else b"test-key-1\n")
    return dirs


def localized(c: Container, dirs: dict[str, Path]) -> tuple[list[str], dict[str, str]]:
    """The argv and environment with paths under the container's mounts moved to the stand-ins."""
    def local(value: str) -> str:
        flag, eq, path = value.rpartition("=") if value.startswith("--") else ("", "", value)
        for mount, what in c.mounts.items():
            if path == mount or path.startswith(mount + "/"):
                return f"{flag}{eq}{dirs[what]}{path[len(mount):]}"
        return value

    return [local(a) for a in c.argv], {k: local(v) for k, v in c.env.items()}


def check_config(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVMESH_", "ETCD_"))}
    return subprocess.run([sys.executable, "-m", *argv, "--check-config"], cwd=ROOT, env={**base, **env},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("where", "service"), all_containers())
def test_every_container_command_passes_its_services_check_config(
        where: str, service: str, stand_ins: dict[str, Path]) -> None:
    c = container(where, service)
    argv, env = localized(c, stand_ins)
    done = check_config(argv, env)
    assert done.returncode == 0, f"{where}/{service}: python -m {' '.join(argv)} --check-config: {done.stderr}"


# A bad value of a real flag for each service: refused as well as a made-up flag.
BAD_VALUES = {"frontend": ["--http-port", "http"], "processor": ["--migration-limit", "-1"],
              "kv-router": ["--router-mode", "fastest"], "decode-worker": ["--engine", "tensorrt"],
              "prefill-worker": ["--kv-transfer", "rdma"], "planner": ["--connector", "magic"]}


@pytest.mark.parametrize("service", MESH_SERVICES)
def test_a_wrong_flag_fails_the_check(service: str, stand_ins: dict[str, Path]) -> None:
    argv, env = localized(container("compose", service), stand_ins)
    for wrong in (["--made-up-flag", "1"], BAD_VALUES[service]):
        done = check_config([*argv, *wrong], env)
        assert done.returncode == 2 and done.stderr.startswith("error: ") and len(done.stderr.splitlines()) == 1, done
        assert wrong[0] in done.stderr, done.stderr
    # A path that exists only in the container fails too: the stand-ins are what makes the check pass.
    if "--model" in argv:
        done = check_config(container("compose", service).argv, env)
        assert done.returncode == 2 and "--model /model" in done.stderr, done.stderr


# -- the image ---------------------------------------------------------------------------------------

def _pip_packages(text: str) -> set[str]:
    """Package names of the `pip install` commands in a shell text (not `-r FILE`, not pip itself)."""
    names: set[str] = set()
    for line in text.splitlines():
        for cmd in re.findall(r"pip install ([^&;\n]+)", line.replace("$PIP install", "pip install")):
            words = [w for w in cmd.split() if not w.startswith("-")]
            skip = {w for prev, w in zip(cmd.split(), cmd.split()[1:]) if prev == "-r"}
            names |= {w for w in words if w not in skip and w != "pip"}
    return names


def test_the_image_installs_what_make_install_installs_on_a_gpu_machine() -> None:
    install = (ROOT / "scripts" / "install.sh").read_text()
    gpu_branch = install[install.index("if command -v nvidia-smi"):install.index("\nelse")]
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert _pip_packages(dockerfile) == _pip_packages(gpu_branch) == {"vllm", "nixl"}
    assert "COPY requirements.txt" in dockerfile and "pip install -r requirements.txt" in dockerfile
    assert re.search(r"\$PIP install (-q )?-r requirements.txt", install)
    for source in ("gen/", "services/", "protos/"):
        assert f"COPY {source} {source}" in dockerfile
        assert f"!{source}" in (DEPLOY / "Dockerfile.dockerignore").read_text()
    assert dockerfile_entrypoint() == ["python", "-m"]


# -- compose -----------------------------------------------------------------------------------------

def test_compose_defines_the_mesh_on_etcd_with_gpus_for_the_workers() -> None:
    services = compose_services()
    assert {"etcd", *MESH_SERVICES} <= set(services)
    for worker in WORKERS:
        assert services[worker]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    for name in MESH_SERVICES:
        spec = services[name]
        assert spec["environment"]["ETCD_ENDPOINTS"] == "http://etcd:2379", name
        assert spec["environment"]["KVMESH_NAMESPACE"] == NAMESPACE, name
        assert spec["depends_on"]["etcd"]["condition"] == "service_healthy", name
        assert spec["restart"] == "on-failure" and spec["volumes"] == ["/srv/model:/model:ro"], name
        # Compose's default 10 s would SIGKILL a drain (--drain-timeout) in the middle.
        assert int(spec["stop_grace_period"].rstrip("s")) > parse(container("compose", name)).drain_timeout
        # The health check asks the service's own side port.
        (port,) = re.findall(r"127\.0\.0\.1:(\d+)/health", " ".join(spec["healthcheck"]["test"]))
        assert int(port) == parse(container("compose", name)).metrics_port, name
    assert services["frontend"]["ports"] == [f"{FRONTEND_PORT}:{FRONTEND_PORT}"]
    assert services["etcd"]["image"] == "quay.io/coreos/etcd:v3.5.17"


def test_the_compose_commands_mean_what_the_deployment_intends() -> None:
    from services.decode_worker.flags import disagg_config
    from services.frontend.flags import frontend_config
    from services.routing.flags import router_config

    parsed = {c.service: parse(c) for c in compose_containers()}
    for name, args in parsed.items():
        mesh = mesh_config(args)
        assert (mesh.host, mesh.drain_timeout_s) == ("0.0.0.0", 30), name
    assert router_config(parsed["kv-router"]).mode == "kv"
    assert parsed["frontend"].http_port == FRONTEND_PORT and frontend_config(parsed["frontend"]).api_keys == ()
    for worker in WORKERS:
        assert (parsed[worker].engine, parsed[worker].model, parsed[worker].kv_transfer) == ("vllm", "/model", "nixl")
    assert {parsed[n].served_model_name for n in ("processor", *WORKERS)} == {"kvmesh-model"}
    assert compose_services({"SERVED_MODEL_NAME": "m"})["processor"]["command"].count("m") == 1
    decode = parsed["decode-worker"]
    disagg = disagg_config(decode, can_receive_kv=decode.kv_transfer == "nixl")
    assert disagg.remote_prefill and disagg.conditional_disagg
    assert (disagg.max_local_prefill_length, disagg.max_prefill_queue_size) == (512, 2)


