"""The Kubernetes manifests, offline: schemas, kustomize rendering, ports, probes, termination and
what each service needs (see tests/test_deploy.py for how deploy/ is checked without a cluster)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from tests.deploy_files import (
    FRONTEND_PORT,
    K8S,
    K8S_VERSION,
    KUSTOMIZATIONS,
    MESH_SERVICES,
    NAMESPACE,
    WORKERS,
    Container,
    compose_containers,
    compose_services,
    container,
    dockerfile_entrypoint,
    expand,
    find,
    kustomization,
    load_all,
    one,
    parse,
    rendered,
    rendered_containers,
)


# -- Kubernetes: schemas and rendering ---------------------------------------------------------------

def _patch_files() -> set[Path]:
    return {(K8S / d / p["path"]).resolve() for d in KUSTOMIZATIONS for p in kustomization(d).get("patches", [])
            if "path" in p}


def _manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml" and p.resolve() not in _patch_files())


def validate(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path", _manifest_files(), ids=lambda p: p.relative_to(K8S).as_posix())
def test_every_manifest_validates_against_the_kubernetes_schemas(path: Path) -> None:
    docs = load_all(path)
    assert docs, path
    for doc in docs:
        validate(doc)


def test_every_manifest_and_patch_is_used_or_an_example() -> None:
    listed = {(K8S / d / r).resolve() for d in KUSTOMIZATIONS for r in kustomization(d).get("resources", [])}
    for path in _manifest_files():
        assert path.resolve() in listed or path.parent.name == "examples", f"{path} is in no kustomization"
    assert all(p.is_file() for p in _patch_files())


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_every_kustomization_renders_and_the_result_validates(directory: str) -> None:
    docs = rendered(directory)
    for doc in docs:
        validate(doc)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("StatefulSet", "etcd"), ("Service", "etcd"), ("Service", "frontend")} <= kinds
    assert {("Deployment", s) for s in MESH_SERVICES} <= kinds and {("PodDisruptionBudget", s) for s in MESH_SERVICES} <= kinds


def test_the_validator_refuses_a_broken_manifest() -> None:
    """So the schema check can fail: a wrong type and an unknown field are both reported."""
    deployment = load_all(K8S / "base" / "frontend.yaml")[0]
    for broken in ({**deployment, "spec": {**deployment["spec"], "replicas": "two"}},
                   {**deployment, "spec": {**deployment["spec"], "replica": 2}}):
        with pytest.raises(kubernetes_validate.ValidationError):
            validate(broken)


# -- Kubernetes: ports, probes, termination, and what the services need --------------------------------

def _pod(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    template = one(docs, kind, name)["spec"]["template"]
    return template, template["spec"]


def _port(spec: dict[str, Any], ref: int | str) -> int:
    return ref if isinstance(ref, int) else {p["name"]: p["containerPort"] for p in spec["ports"]}[ref]


def _workloads(docs: tuple[dict[str, Any], ...], selector: dict[str, str]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")
            and selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_ports_probes_and_termination_agree_with_the_flags_and_compose(directory: str) -> None:
    docs = rendered(directory)
    composed = {c.service: parse(c) for c in compose_containers()}
    for c in rendered_containers(directory):
        args, template = parse(c), one(docs, "Deployment", c.service)["spec"]["template"]
        (spec,) = template["spec"]["containers"]
        # The planner serves no API of its own: only its metrics port.
        public = {"http": args.http_port} if c.service == "frontend" else {} if c.service == "planner" else \
            {"grpc": args.port}
        assert {p["name"]: p["containerPort"] for p in spec["ports"]} == {**public, "metrics": args.metrics_port}
        assert template["metadata"]["annotations"]["prometheus.io/port"] == str(args.metrics_port)
        for flag in ("port", "http_port", "metrics_port"):
            assert getattr(args, flag, None) == getattr(composed[c.service], flag, None), (c.service, flag)
        for probe, path in (("readinessProbe", "/health"), ("livenessProbe", "/live"), ("startupProbe", "/health")):
            if probe in spec or probe != "startupProbe":
                get = spec[probe]["httpGet"]
                assert (get["path"], _port(spec, get["port"])) == (path, args.metrics_port), (c.service, probe)
        sleep, seconds = spec["lifecycle"]["preStop"]["exec"]["command"]
        assert sleep == "sleep" and template["spec"]["terminationGracePeriodSeconds"] > int(seconds) + args.drain_timeout
    assert parse(container(directory, "frontend")).http_port == FRONTEND_PORT  # the public port of docs/reference.md


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_services_budgets_and_ingress_select_what_exists(directory: str) -> None:
    docs = rendered(directory)
    for workload in _workloads(docs, {}):
        assert workload["spec"]["selector"]["matchLabels"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()
    for svc in find(docs, "Service"):
        (target,) = _workloads(docs, svc["spec"]["selector"])
        (spec,) = target["spec"]["template"]["spec"]["containers"]
        for port in svc["spec"]["ports"]:
            assert _port(spec, port.get("targetPort", port["port"])) in {p["containerPort"] for p in spec["ports"]}
    frontend = one(docs, "Service", "frontend")["spec"]["ports"]
    assert [(p["port"], p["targetPort"]) for p in frontend] == [(FRONTEND_PORT, "http")]
    for pdb in find(docs, "PodDisruptionBudget"):
        assert len(_workloads(docs, pdb["spec"]["selector"]["matchLabels"])) == 1, pdb["metadata"]["name"]
    for ingress in find(docs, "Ingress"):
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                backend = path["backend"]["service"]
                assert backend["port"]["name"] in {p["name"] for p in one(docs, "Service", backend["name"])["spec"]["ports"]}


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_every_service_binds_all_interfaces_advertises_its_pod_ip_and_gets_what_it_needs(directory: str) -> None:
    docs = rendered(directory)
    served = set()
    for c in rendered_containers(directory):
        _, pod = _pod(docs, "Deployment", c.service)
        (spec,) = pod["containers"]
        raw = " ".join(spec["args"])
        assert "--host 0.0.0.0" in raw and "--advertise-host $(POD_IP)" in raw, c.service
        assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in spec["env"]
        assert {"cpu", "memory"} <= set(spec["resources"]["requests"]), c.service
        args = parse(c)
        if c.service in WORKERS:
            # A GPU exactly where a real engine runs (dev runs mockers).
            assert spec["resources"]["limits"].get("nvidia.com/gpu") == (1 if args.engine == "vllm" else None)
        if c.service in ("processor", *WORKERS):
            (mount,) = [m for m in spec["volumeMounts"] if m["mountPath"] == "/model"]
            assert args.model == "/model" and c.mounts["/model"] == "model" and mount["readOnly"], c.service
            served.add(args.served_model_name)
    assert len(served) == 1, served
    replicas = {d["metadata"]["name"]: d["spec"]["replicas"] for d in find(docs, "Deployment")}
    if directory == "overlays/dev":
        assert set(replicas.values()) == {1}
    else:
        assert replicas["kv-router"] == 2 and min(replicas.values()) >= 1


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_etcd_is_a_three_member_cluster_that_every_service_can_reach(directory: str) -> None:
    docs = rendered(directory)
    sts = one(docs, "StatefulSet", "etcd")
    name, members, headless = sts["metadata"]["name"], sts["spec"]["replicas"], sts["spec"]["serviceName"]
    svc = one(docs, "Service", headless)["spec"]
    assert members == 3 and svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is True
    pod = sts["spec"]["template"]["spec"]
    (spec,) = pod["containers"]
    assert spec["image"] == "quay.io/coreos/etcd:v3.5.17"
    flags = dict((a[2:].split("=", 1) + [""])[:2] for a in spec["args"])
    scheme = flags["listen-client-urls"].split(":")[0]
    peer, client = _port(spec, "peer"), _port(spec, "client")
    assert flags["initial-cluster"] == ",".join(f"{name}-{i}={scheme}://{name}-{i}.{headless}:{peer}" for i in range(members))
    assert flags["name"] == "$(POD_NAME)" and flags["listen-peer-urls"] == f"{scheme}://0.0.0.0:{peer}"
    assert flags["initial-advertise-peer-urls"] == f"{scheme}://$(POD_NAME).{headless}:{peer}"
    assert flags["advertise-client-urls"] == f"{scheme}://$(POD_NAME).{headless}:{client}"
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    (data,) = [m for m in spec["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert flags["data-dir"].startswith(data["mountPath"] + "/")
    anti = pod["affinity"]["podAntiAffinity"]
    terms = anti.get("requiredDuringSchedulingIgnoredDuringExecution") or \
        [t["podAffinityTerm"] for t in anti["preferredDuringSchedulingIgnoredDuringExecution"]]
    assert terms[0]["topologyKey"] == "kubernetes.io/hostname"
    assert terms[0]["labelSelector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert ("requiredDuringSchedulingIgnoredDuringExecution" in anti) == (directory != "overlays/dev")
    for c in rendered_containers(directory):
        assert c.env["ETCD_ENDPOINTS"] == ",".join(f"{scheme}://{name}-{i}.{headless}:{client}" for i in range(members))
        assert c.env["KVMESH_NAMESPACE"] == NAMESPACE == compose_services()[c.service]["environment"]["KVMESH_NAMESPACE"]
        assert c.env["KVMESH_LOG_FORMAT"] in ("json", "text")
        # https etcd means mutual TLS everywhere: every service has the mesh certificate mounted.
        tls = [c.env.get(k, "") for k in ("KVMESH_TLS_CERT", "KVMESH_TLS_KEY", "KVMESH_TLS_CA")]
        assert all(c.mounts.get(p.rpartition("/")[0], "").startswith("secret:") for p in tls) == (scheme == "https")
    if scheme == "https":
        mounts = {m["mountPath"] for m in spec["volumeMounts"] if m["name"] != claim["metadata"]["name"]}
        assert "client-cert-auth" in flags and "peer-client-cert-auth" in flags
        for f in ("cert-file", "key-file", "trusted-ca-file", "peer-cert-file", "peer-key-file", "peer-trusted-ca-file"):
            assert flags[f].rpartition("/")[0] in mounts, f


def test_the_dev_demo_model_is_built_where_the_services_read_it() -> None:
    import importlib.util

    for deployment in find(rendered("overlays/dev"), "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        (spec,) = pod["containers"]
        model = [m for m in spec.get("volumeMounts", []) if m["mountPath"] == "/model"]
        if not model:
            continue
        (init,) = pod["initContainers"]
        module, *flags = [*init.get("command", dockerfile_entrypoint()), *init["args"]][2:]
        assert module == "services.tools.make_demo_model" and importlib.util.find_spec(module) is not None
        parent, _, name = flags[flags.index("--out") + 1].rpartition("/")
        (mount,) = [m for m in init["volumeMounts"] if m["mountPath"] == parent]
        assert (model[0]["name"], model[0]["subPath"]) == (mount["name"], name)
        assert "emptyDir" in {v["name"]: v for v in pod["volumes"]}[mount["name"]]



def test_the_planner_may_scale_exactly_the_worker_deployments_it_plans() -> None:
    docs = tuple(d for f in ("planner.yaml", "decode-worker.yaml", "prefill-worker.yaml") for d in load_all(K8S / "base" / f))
    deployment = one(docs, "Deployment", "planner")
    pod = deployment["spec"]["template"]["spec"]
    args = parse(rendered_like(deployment))
    assert (args.connector, args.k8s_namespace) == ("kubernetes", NAMESPACE)
    targets = {args.k8s_prefill_deployment, args.k8s_decode_deployment}
    assert targets == set(WORKERS) and all(find(docs, "Deployment", t) for t in targets)
    account = pod["serviceAccountName"]
    binding = one(docs, "RoleBinding", account)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    role = one(docs, "Role", binding["roleRef"]["name"])
    (scale,) = [r for r in role["rules"] if "deployments/scale" in r["resources"]]
    assert {"get", "patch"} <= set(scale["verbs"]) and set(scale["resourceNames"]) == targets
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"


def rendered_like(deployment: dict[str, Any]) -> Container:
    """A base Deployment's container as `rendered_containers` would give it (namespace kvmesh)."""
    (spec,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {"POD_IP": "127.0.0.1", "POD_NAMESPACE": NAMESPACE}
    return Container("base", deployment["metadata"]["name"], [expand(a, env) for a in spec["args"]], env)
