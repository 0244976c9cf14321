"""The deploy files as the tests read them: compose and rendered Kubernetes containers, their
commands and environment, and the Kubernetes schema check."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.procs import ROOT

DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
K8S_VERSION = "1.32"
MODULES = {"frontend": "services.frontend", "processor": "services.processor", "kv-router": "services.kv_router",
           "decode-worker": "services.decode_worker", "prefill-worker": "services.prefill_worker",
           "planner": "services.planner"}
MESH_SERVICES = tuple(MODULES)
WORKERS = ("decode-worker", "prefill-worker")
KUSTOMIZATIONS = sorted(p.parent.relative_to(K8S).as_posix() for p in K8S.rglob("kustomization.yaml"))
# From docs/reference.md: the frontend's public port, the mesh's etcd key namespace.
FRONTEND_PORT, NAMESPACE = 8000, "kvmesh"


def load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kustomization(directory: str) -> dict[str, Any]:
    return yaml.safe_load((K8S / directory / "kustomization.yaml").read_text())


def dockerfile_entrypoint() -> list[str]:
    (line,) = [ln for ln in (DEPLOY / "Dockerfile").read_text().splitlines() if ln.startswith("ENTRYPOINT")]
    return yaml.safe_load(line.removeprefix("ENTRYPOINT"))


@functools.cache
def rendered(directory: str) -> tuple[dict[str, Any], ...]:
    if shutil.which("kubectl") is None:
        reason = "kubectl is not on PATH: cannot render kustomizations (install kubectl >= 1.27 to run this)"
        if os.environ.get("CI"):  # CI's machines have kubectl: a render check must not vanish there
            pytest.fail(reason)
        pytest.skip(reason)
    out = subprocess.run(["kubectl", "kustomize", str(K8S / directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {directory}: {out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def find(docs: tuple[dict[str, Any], ...], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]


def one(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    (doc,) = find(docs, kind, name)
    return doc


# -- containers, as compose and Kubernetes would start them ----------------------------------------

@dataclass
class Container:
    where: str
    service: str
    argv: list[str]  # what follows `python -m`
    env: dict[str, str]
    # container path -> what is mounted there: "model", "secret:<name>" or "scratch"
    mounts: dict[str, str] = field(default_factory=dict)


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error} in every string."""
    if isinstance(value, str):
        return re.sub(r"\$\{(\w+)(?::[-?]([^}]*))?\}", lambda m: env.get(m[1]) or m[2] or "", value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def compose_services(env: dict[str, str] | None = None) -> dict[str, Any]:
    spec = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    return interpolate(spec, {"MODEL_DIR": "/srv/model", **(env or {})})


def compose_containers() -> list[Container]:
    out = []
    for name in MESH_SERVICES:
        spec = compose_services()[name]
        mounts = {v.split(":")[1]: "model" for v in spec.get("volumes", []) if v.startswith("/srv/model:")}
        out.append(Container("compose", name, list(spec["command"]), {k: str(v) for k, v in spec["environment"].items()},
                             mounts))
    return out


def _env_of(spec: dict[str, Any], docs: tuple[dict[str, Any], ...]) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in spec.get("envFrom", []):
        env.update(one(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in spec.get("env", []):
        ref = var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        env[var["name"]] = {"status.podIP": "127.0.0.1", "metadata.name": "pod-0", "metadata.namespace": NAMESPACE,
                            None: var.get("value", "")}[ref]
    return env


def _mounts_of(spec: dict[str, Any], pod: dict[str, Any]) -> dict[str, str]:
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = {}
    for m in spec.get("volumeMounts", []):
        v = volumes[m["name"]]
        if "secret" in v:
            mounts[m["mountPath"]] = f"secret:{v['secret']['secretName']}"
        # The model volume, or (dev) the demo model an init container builds into an emptyDir.
        elif v.get("persistentVolumeClaim", {}).get("claimName") == "kvmesh-model" or m.get("subPath") == "kvmesh-demo":
            mounts[m["mountPath"]] = "model"
        else:
            mounts[m["mountPath"]] = "scratch"
    return mounts


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes expands $(VAR) in command and args from the container's environment."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), arg)


def rendered_containers(directory: str) -> list[Container]:
    docs, out = rendered(directory), []
    for deployment in find(docs, "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        (spec,) = pod["containers"]
        argv = [*spec.get("command", dockerfile_entrypoint()), *spec.get("args", [])]
        assert argv[:2] == ["python", "-m"], f"{directory}/{deployment['metadata']['name']}: {argv}"
        env = _env_of(spec, docs)
        out.append(Container(directory, deployment["metadata"]["name"], [expand(a, env) for a in argv[2:]], env,
                             _mounts_of(spec, pod)))
    return out


def all_containers() -> list[tuple[str, str]]:
    return [("compose", name) for name in MESH_SERVICES] + [(d, s) for d in KUSTOMIZATIONS for s in MESH_SERVICES]


def container(where: str, service: str) -> Container:
    found = compose_containers() if where == "compose" else rendered_containers(where)
    (c,) = [c for c in found if c.service == service]
    return c


def parse(c: Container) -> Any:
    """The container's flags parsed by its module's own parser (in this process; see --check-config below)."""
    import services.decode_worker.__main__ as decode
    import services.frontend.__main__ as frontend
    import services.kv_router.__main__ as router
    import services.planner.__main__ as planner
    import services.prefill_worker.__main__ as prefill
    import services.processor.__main__ as processor
    from services.worker.runtime import worker_parser

    parsers = {"services.frontend": frontend.parser, "services.processor": processor.parser,
               "services.kv_router": router.parser, "services.decode_worker": lambda: worker_parser(decode.ROLE),
               "services.prefill_worker": lambda: worker_parser(prefill.ROLE), "services.planner": planner.parser}
    module, *flags = c.argv
    assert module == MODULES[c.service], f"{c.where}/{c.service} runs {module}"
    return parsers[module]().parse_args(flags)


