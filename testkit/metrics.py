"""The one reader of Prometheus metrics, the tests' and the benchmarks': a process's /metrics page
fetched and parsed into samples (`scrape`; `parse` for text in hand), and small readers of those
samples, or of a page's text: a metric summed over the label sets that include some labels
(`total`), the one sample of a metric and labels (`value`; `find` where there may be none yet),
and a metric's values keyed by some of its labels (`by_labels`).

On top, `routers_heard_every_worker`: the condition a test waits on where it used to sleep for
the workers' next load reports."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from services.mesh.discovery import ROUTER
from testkit.mesh import registered

# A page's text, or its samples.
Samples = str | Iterable[Sample]


def parse(text: str) -> list[Sample]:
    """Every sample of a Prometheus text page."""
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def metrics_url(port: int) -> str:
    """The /metrics page of a process on this host, by its side port (an etcd record's `metrics_port`)."""
    return f"http://127.0.0.1:{port}/metrics"


def scrape(url: str, timeout_s: float = 10) -> list[Sample]:
    """The samples of the /metrics page at `url`."""
    return parse(httpx.get(url, timeout=timeout_s).text)


def matching(samples: Samples, name: str, **labels: str) -> list[Sample]:
    """The samples called `name` whose labels include `labels` (and any others)."""
    return [s for s in (parse(samples) if isinstance(samples, str) else samples)
            if s.name == name and labels.items() <= s.labels.items()]


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples called `name` that carry `labels` (0 when there is none yet)."""
    return sum((s.value for s in matching(samples, name, **labels)), 0.0)


def find(samples: Samples, name: str, **labels: str) -> float | None:
    """The value of the one sample called `name` that carries `labels` (None when there is none);
    labels that leave several are a mistake of the caller's."""
    found = matching(samples, name, **labels)
    assert len(found) <= 1, f"{len(found)} samples {name}{labels}: name the labels that tell them apart"
    return found[0].value if found else None


def value(samples: Samples, name: str, **labels: str) -> float:
    """`find`, for a sample that must be there."""
    found = find(samples, name, **labels)
    assert found is not None, f"no sample {name}{labels} in /metrics"
    return found


def by_labels(samples: Samples, name: str, *keys: str) -> dict[tuple[str, ...], float]:
    """The samples called `name`, keyed by the values of their labels `keys`."""
    return {tuple(s.labels[k] for k in keys): s.value for s in matching(samples, name)}


def routers_heard_every_worker(etcd: str, namespace: str) -> Callable[[], bool]:
    """A condition, armed now: every router of the mesh has heard a load report from each of its
    workers since, and counts no request it sent as pending (services/routing/worker_pool.py).
    So a router sees the workers between requests that are not a burst: the loads it weighs are
    the workers' own, with no request of its own on top."""

    def reports() -> dict[tuple[str, str], tuple[float, float]]:
        """(router, worker) -> (load reports heard, requests pending)."""
        out = {}
        for router in registered(etcd, namespace, ROUTER):
            samples = scrape(metrics_url(router.metrics_port))
            pending = by_labels(samples, "kvmesh_router_pending_requests", "worker_id")
            for (worker,), heard in by_labels(samples, "kvmesh_router_load_reports_total", "worker_id").items():
                out[(router.instance_id, worker)] = (heard, pending.get((worker,), 0.0))
        return out

    before = reports()

    def heard() -> bool:
        now = reports()
        return bool(now) and all(n > before.get(key, (0.0, 0.0))[0] and not pending
                                 for key, (n, pending) in now.items())

    return heard
