"""The kubernetes connector: the plan as the replica counts of the two worker Deployments.

It reads and patches each Deployment's `scale` subresource (autoscaling/v1 `Scale`) with the
official client, so the planner needs only `get` and `patch` on `deployments/scale` in its
namespace (deploy/k8s/base/planner.yaml). Kubernetes starts and stops the pods; a stopped pod
drains first (preStop, then SIGTERM), so nothing in flight is lost. Roles are not switched on
Kubernetes: a pod belongs to its Deployment.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kubernetes import client, config  # type: ignore[import-untyped]
from kubernetes.client.exceptions import ApiException  # type: ignore[import-untyped]
from urllib3.exceptions import HTTPError

from services.config_error import ConfigError
from services.planner.connectors.base import ConnectorError
from services.contract.worker_roles import RoleName
from services.planner.pools import ROLES, PoolSizes

# The API server answers in milliseconds; one that takes longer than this is unreachable for a
# plan that will be made again at the next interval anyway.
CALL_TIMEOUT_S = 10.0
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
T = TypeVar("T")


@dataclass(frozen=True)
class KubernetesTarget:
    namespace: str
    prefill_deployment: str = "prefill-worker"
    decode_deployment: str = "decode-worker"

    def __post_init__(self) -> None:
        for flag, name in (("--k8s-namespace", self.namespace), ("--k8s-prefill-deployment", self.prefill_deployment),
                           ("--k8s-decode-deployment", self.decode_deployment)):
            if not _DNS_LABEL.match(name):
                raise ConfigError(f"{flag}: {name!r} is not a Kubernetes name (lowercase letters, digits and '-')")

    def deployment(self, role: RoleName) -> str:
        return self.prefill_deployment if role == RoleName.PREFILL else self.decode_deployment


def scale_patch(replicas: int) -> dict[str, Any]:
    """The merge patch that sets a Deployment's replicas through its scale subresource."""
    return {"spec": {"replicas": replicas}}


def from_environment(target: KubernetesTarget) -> KubernetesConnector:
    """A connector with the pod's service account, or else the user's kubeconfig."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as exc:
            raise ConnectorError(f"no Kubernetes credentials: not in a pod, and no usable kubeconfig ({exc})") from exc
    return KubernetesConnector(target, client.ApiClient())


class KubernetesConnector:
    name = "kubernetes"
    acts = True

    def __init__(self, target: KubernetesTarget, api_client: client.ApiClient) -> None:
        self.target = target
        self._client = api_client
        self._apps = client.AppsV1Api(api_client)

    async def current(self) -> PoolSizes | None:
        prefill, decode = await asyncio.gather(self._replicas(RoleName.PREFILL), self._replicas(RoleName.DECODE))
        return PoolSizes(prefill, decode)

    async def apply(self, current: PoolSizes, desired: PoolSizes) -> int:
        changes = [role for role in ROLES if desired.of(role) != current.of(role)]
        await asyncio.gather(*(self._scale(role, desired.of(role)) for role in changes))
        return 0  # pods are started and stopped, never switched

    async def close(self) -> None:
        await asyncio.to_thread(self._client.close)

    async def _replicas(self, role: RoleName) -> int:
        name = self.target.deployment(role)
        scale = await self._call(name, lambda: self._apps.read_namespaced_deployment_scale(
            name, self.target.namespace, _request_timeout=CALL_TIMEOUT_S))
        return int(scale.spec.replicas or 0) if scale.spec is not None else 0

    async def _scale(self, role: RoleName, replicas: int) -> None:
        name = self.target.deployment(role)
        await self._call(name, lambda: self._apps.patch_namespaced_deployment_scale(
            name, self.target.namespace, scale_patch(replicas), _request_timeout=CALL_TIMEOUT_S))

    async def _call(self, deployment: str, call: Callable[[], T]) -> T:
        """Runs a blocking client call off the event loop, under a deadline, with one-line errors."""
        where = f"deployment {self.target.namespace}/{deployment}"
        try:
            return await asyncio.wait_for(asyncio.to_thread(call), CALL_TIMEOUT_S)
        except ApiException as exc:
            raise ConnectorError(f"{where}: the API server answered {exc.status} {exc.reason}") from exc
        except (HTTPError, OSError) as exc:
            raise ConnectorError(f"{where}: the API server is unreachable ({exc})") from exc
        except TimeoutError as exc:
            raise ConnectorError(f"{where}: no answer within {CALL_TIMEOUT_S:.0f}s") from exc
