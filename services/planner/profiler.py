"""python -m services.planner profile: measures one real worker and writes its profile.

It finds a worker in etcd (a decode worker, or the one `--worker-id` names), talks to its
gRPC `Worker.Generate` directly (no router, processor or frontend in the way), and sweeps:

- **prefill**: one prompt at a time, each length `--repeats` times, a fresh random prompt each
  time (nothing cached); the time to the first token is the prefill.
- **decode**: `b` streams at once with prompts of `c` tokens; once every stream has its first
  token and until the first one ends, the batch decodes b sequences per step: the step time is
  that window over the tokens each stream got in it.

- **LoRA adapter loads** (a worker serving adapters): each known adapter (up to
  `--adapter-samples`) is loaded under a temporary name with `Worker.LoadLoraAdapter(load=True)`
  and forgotten again, twice; the call's time is the load.

Then it fits the cost model (services/profiles/fit.py) and writes the profile with the worker's
engine, model and block size and this machine's name. The default sweep is 6 lengths x 3 + 4 x 2
batches = 26 runs (minutes on a CPU, seconds on a GPU); the fit needs 3 lengths and 3 (batch,
context) pairs at the least. NVIDIA Dynamo's pre-deployment profiling sweeps parallelism
configurations as well, for hours; this sweeps one worker as deployed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import logging
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import grpc

from gen.kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.mesh.channels import open_channel
from services.mesh.discovery import DECODE_WORKER, PREFILL_WORKER, InstanceInfo, component_prefix
from services.mesh.etcd_store import EtcdStore
from services.mesh.flags import FlagParser, add_mesh_flags, die, mesh_config, non_negative_int, positive_int
from services.mesh.logs import setup_logging
from services.profiles.cost_model import ProfileError
from services.profiles.fit import fit_adapter_load, fit_cost_model, fit_error
from services.profiles.profile_file import WorkerProfile, save_profile

log = logging.getLogger("profile")

# Random prompt tokens: above the ids tokenizers keep for special tokens, inside any vocabulary.
TOKEN_LOW, TOKEN_HIGH = 20, 1000
# A measurement in the decode window needs this many tokens per stream to mean anything.
MIN_WINDOW_TOKENS = 4
# Loads per sampled adapter: the first may also pay a cold file cache.
ADAPTER_LOADS_EACH = 2


def ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected integers > 0, got {text!r}")
    return values


def parser() -> FlagParser:
    p = FlagParser(prog="python -m services.planner profile",
                   description="Measure one worker and write its profile for the planner (--profile) and the "
                               "mocker (--timing-profile).")
    add_mesh_flags(p)
    p.add_argument("--out", required=True, type=Path, help="the profile file to write")
    p.add_argument("--worker-id", default=None, help="the worker to measure (default: any decode worker)")
    p.add_argument("--prompt-lengths", type=ints, default=(128, 256, 512, 1024, 2048, 4096))
    p.add_argument("--repeats", type=positive_int, default=3, help="prefills per prompt length (the median counts)")
    p.add_argument("--batch-sizes", type=ints, default=(1, 4, 16, 64))
    p.add_argument("--contexts", type=ints, default=(256, 1024), help="prompt tokens of each decode stream")
    p.add_argument("--decode-tokens", type=positive_int, default=32,
                   help="tokens each decode stream generates past the prefill of the whole batch")
    p.add_argument("--adapter-samples", type=non_negative_int, default=4,
                   help="LoRA adapters of the worker whose load time is measured (0: none; a worker without LoRA: none)")
    p.add_argument("--machine", default=None, help="what the profile says it was measured on (default: this host)")
    p.add_argument("--timeout", type=positive_int, default=600, help="seconds any one run may take")
    return p


@dataclass(frozen=True)
class Target:
    info: InstanceInfo
    stub: worker_pb2_grpc.WorkerStub
    timeout_s: float


async def find_worker(store: EtcdStore, namespace: str, worker_id: str | None) -> InstanceInfo:
    found: list[InstanceInfo] = []
    for component in (DECODE_WORKER, PREFILL_WORKER):
        entries, _ = await store.get_prefix(component_prefix(namespace, component))
        found += [InstanceInfo.from_json(kv.value) for kv in entries]
    if worker_id is not None:
        found = [w for w in found if w.instance_id == worker_id]
    if not found:
        raise SystemExit(f"profile: no {'worker ' + worker_id if worker_id else 'worker'} registered in namespace "
                         f"{namespace!r}; start one (python -m services.launch ...) first")
    return sorted(found, key=lambda w: w.component != DECODE_WORKER)[0]


def _prompt(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(tokens)]


async def _stream(target: Target, rid: str, prompt: list[int], max_tokens: int) -> list[tuple[float, int]]:
    """(arrival time, tokens in the message) of every message of one generation."""
    request = worker_pb2.WorkerGenerateRequest(
        request_id=rid, token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True,
                                           temperature=0.0))
    arrivals = []
    async for msg in target.stub.Generate(request, timeout=target.timeout_s):
        if msg.token_ids:
            arrivals.append((time.perf_counter(), len(msg.token_ids)))
    return arrivals


async def prefill_point(target: Target, rng: random.Random, tokens: int, repeats: int) -> float:
    seconds = []
    for i in range(repeats):
        started = time.perf_counter()
        arrivals = await _stream(target, f"profile-prefill-{tokens}-{i}-{rng.getrandbits(32):08x}",
                                 _prompt(rng, tokens), 1)
        if not arrivals:
            raise ProfileError(f"a {tokens}-token prompt produced no token")
        seconds.append(arrivals[0][0] - started)
    return statistics.median(seconds)


async def decode_point(target: Target, rng: random.Random, batch: int, context: int, decode_tokens: int) -> float:
    tag = f"{rng.getrandbits(32):08x}"
    streams = await asyncio.gather(*(_stream(target, f"profile-decode-{batch}-{context}-{i}-{tag}",
                                             _prompt(rng, context), decode_tokens) for i in range(batch)))
    if not all(streams):
        raise ProfileError(f"decode batch {batch} at context {context}: a stream produced no token")
    start = max(s[0][0] for s in streams)  # every stream decoding from here ...
    end = min(s[-1][0] for s in streams)  # ... until the first one ends
    counts = [sum(n for at, n in s if start < at <= end) for s in streams]
    tokens = statistics.mean(counts)
    if tokens < MIN_WINDOW_TOKENS:
        raise ProfileError(f"decode batch {batch} at context {context}: only {tokens:.1f} tokens per stream while "
                           f"the whole batch decoded; raise --decode-tokens")
    return (end - start) / tokens


async def known_adapters(target: Target) -> list[worker_pb2.LoraAdapterState]:
    """The adapters the worker knows, from its first load report (none without LoRA)."""
    call = target.stub.SubscribeMetrics(worker_pb2.SubscribeMetricsRequest(), timeout=target.timeout_s)
    try:
        async for metrics in call:
            return list(metrics.lora_adapters)
        return []
    finally:
        call.cancel()


async def adapter_loads(target: Target, rng: random.Random, samples: int) -> list[tuple[int, float]]:
    """(size_bytes, seconds) of loading each sampled adapter under a temporary name, then forgetting it."""
    loads: list[tuple[int, float]] = []
    for adapter in (await known_adapters(target))[:samples]:
        for i in range(ADAPTER_LOADS_EACH):
            name = f"profile-{adapter.lora_name}-{i}-{rng.getrandbits(32):08x}"
            started = time.perf_counter()
            await target.stub.LoadLoraAdapter(worker_pb2.LoadLoraAdapterRequest(
                lora_name=name, lora_path=adapter.lora_path, load=True), timeout=target.timeout_s)
            seconds = time.perf_counter() - started
            await target.stub.UnloadLoraAdapter(worker_pb2.UnloadLoraAdapterRequest(lora_name=name),
                                                timeout=target.timeout_s)
            loads.append((adapter.size_bytes, seconds))
            print(f"profile: adapter {adapter.lora_name} ({adapter.size_bytes} bytes) loaded in "
                  f"{seconds * 1000:.1f} ms", flush=True)
    return loads


async def sweep(args: argparse.Namespace, target: Target) -> WorkerProfile:
    rng = random.Random()
    info = target.info
    print(f"profile: measuring {info.component} {info.instance_id} at {info.address} ({info.engine} engine, model "
          f"{info.model}, block size {info.block_size})", flush=True)
    await _stream(target, f"profile-warmup-{rng.getrandbits(32):08x}", _prompt(rng, 64), 4)  # compile, allocate
    prefill: list[tuple[int, float]] = []
    for n in args.prompt_lengths:
        s = await prefill_point(target, rng, n, args.repeats)
        prefill.append((n, s))
        print(f"profile: prefill {n:6d} tokens: {s * 1000:9.2f} ms (median of {args.repeats})", flush=True)
    decode: list[tuple[int, int, float]] = []
    for c in args.contexts:
        for b in args.batch_sizes:
            s = await decode_point(target, rng, b, c, args.decode_tokens)
            decode.append((b, c + args.decode_tokens // 2, s))
            print(f"profile: decode batch {b:4d}, context {c:6d}: {s * 1000:9.2f} ms per step", flush=True)
    cost = fit_cost_model(prefill, decode)
    loads = await adapter_loads(target, rng, args.adapter_samples) if args.adapter_samples > 0 else []
    if loads:
        base, per_gb = fit_adapter_load(loads)
        cost = replace(cost, adapter_load_base_s=base, adapter_load_s_per_gb=per_gb)
    return WorkerProfile(
        cost, engine=info.engine, model=info.model, block_size=info.block_size,
        machine=args.machine or f"{platform.node()} ({platform.machine()}, {platform.processor() or 'cpu'})",
        measured_at=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        source=f"measured by python -m services.planner profile on worker {info.instance_id}",
        prefill_points=tuple(prefill), decode_points=tuple(decode), fit_error=fit_error(cost, prefill, decode))


async def run(args: argparse.Namespace) -> WorkerProfile:
    mesh = mesh_config(args)
    store = EtcdStore(mesh.etcd_endpoints, tls=mesh.tls)
    await store.connect()
    try:
        info = await find_worker(store, mesh.namespace, args.worker_id)
    finally:
        await store.close()
    channel = open_channel(info.address, mesh.tls)
    try:
        return await sweep(args, Target(info, worker_pb2_grpc.WorkerStub(channel), args.timeout))
    finally:
        await channel.close()


def main(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    setup_logging(args.log_level, "profile", args.log_format)
    try:
        profile = asyncio.run(run(args))
    except ProfileError as exc:
        die(f"profile: {exc}")
    except grpc.aio.AioRpcError as exc:
        die(f"profile: the worker failed a run: {exc.code().name} {exc.details()}")
    save_profile(profile, args.out)
    c = profile.cost
    print(f"profile: wrote {args.out}: prefill {c.prefill_base_s * 1e3:.2f} ms + {c.prefill_per_token_s * 1e6:.2f} us "
          f"per token (+{c.prefill_quadratic_s_per_1k * 1e6:.3f} us x n/1k); decode step {c.decode_base_s * 1e3:.2f} ms "
          f"+ {c.decode_per_seq_s * 1e6:.1f} us per sequence + {c.decode_per_context_token_s * 1e9:.2f} ns per context "
          f"token; adapter load {c.adapter_load_base_s * 1e3:.1f} ms + {c.adapter_load_s_per_gb:.2f} s per GB; "
          f"median fit error prefill {profile.fit_error['prefill']:.1%}, decode "
          f"{profile.fit_error['decode']:.1%}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
