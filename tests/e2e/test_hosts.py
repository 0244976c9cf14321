"""The mesh across hosts (network namespaces on a bridge, `bench/hosts/`): every process on its
own address, nothing registered on loopback; a decode worker cut from every other host in the
middle of streams loses and corrupts nothing (its requests move across hosts, exactly), and once
healed it is registered again within a lease TTL plus 2 s, without a restart. Skipped, with the
reason, where namespaces cannot be made (not root)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.hosts.mesh import HostsMesh, isolate, rejoin
from bench.hosts.netns import PREFIX, Bed, remove_stale, unavailable
from services.mesh.discovery import DECODE_WORKER, FRONTEND, PROCESSOR, ROUTER
from services.mesh.etcd_lease import LeaseConfig
from tests.procs import MODEL

WHY_NOT = unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")

PROMPTS = [f"across hosts {i}: " + "lorem ipsum " * (i + 1) for i in range(8)]
TOKENS = 200
CUT_AFTER_S, CUT_FOR_S = 0.5, 12.0
HEALED_WITHIN_S = LeaseConfig().ttl_s + 2.0


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[HostsMesh]:
    with Bed(6) as bed:
        placed = HostsMesh(bed, tmp_path)
        try:
            asyncio.run(placed.start())
            yield placed
        finally:
            codes = asyncio.run(placed.stop())
            assert all(code in (0, -15) for code in codes.values()), codes
    assert remove_stale(PREFIX) == []  # the bed took everything with it


async def _complete(client: httpx.AsyncClient, base: str, prompt: str) -> str:
    r = await client.post(f"{base}/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": TOKENS,
                                                      "seed": 7})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


async def _scenario(mesh: HostsMesh) -> None:
    everyone = {c: await mesh.instances(c) for c in (ROUTER, PROCESSOR, FRONTEND, DECODE_WORKER)}
    addresses = {i.address.rsplit(":", 1)[0] for infos in everyone.values() for i in infos}
    assert addresses == {mesh.front.address, *(h.address for h in mesh.worker_hosts)}, addresses
    async with httpx.AsyncClient(timeout=120) as client:
        expected = await asyncio.gather(*(_complete(client, mesh.base_url, p) for p in PROMPTS))
        victim, rest = mesh.worker_hosts[0], [h for h in mesh.bed.hosts if h is not mesh.worker_hosts[0]]
        victim_pid = next(c for c in mesh.children if c.name == "decode-worker-1").pid
        streams = [asyncio.create_task(_complete(client, mesh.base_url, p)) for p in PROMPTS]
        await asyncio.sleep(CUT_AFTER_S)
        isolate(victim, rest)
        try:
            got = await asyncio.gather(*streams)
            assert got == expected  # every request answered, exactly, none twice
            await asyncio.sleep(max(0.0, CUT_FOR_S - CUT_AFTER_S))
        finally:
            rejoin(victim, rest)
    healed = time.monotonic()
    while not any(i.address.startswith(victim.address) for i in await mesh.instances(DECODE_WORKER)):
        assert time.monotonic() - healed < HEALED_WITHIN_S, "the cut worker was not registered again in time"
        await asyncio.sleep(0.2)
    assert os.path.exists(f"/proc/{victim_pid}"), "the cut worker restarted instead of rejoining"


def test_a_worker_cut_from_every_host_mid_stream_loses_nothing_and_rejoins(mesh: HostsMesh) -> None:
    asyncio.run(_scenario(mesh))
