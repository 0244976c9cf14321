"""Real KV transfers for the mocker: synthetic KV bytes moved between processes with NIXL.

A prefill worker keeps each prefilled prompt's KV (bytes_per_token per prompt token, content a
function of the tokens) in a slice of an arena registered once with its NIXL agent (as engines
register their KV cache), until the decode worker that pulled it says it is done, the decode
side gives up (ReleaseKv), or a lease runs out. A decode worker reads it with one NIXL READ into
a slice of its own registered arena and verifies the checksum.

The KV of a prompt prefilled with a LoRA adapter is that adapter's: the pull parameters name it
(`lora_name`), and a decode worker refuses to pull it for a request that runs another adapter
(or the base model) rather than decode from the wrong KV.

Agents find each other through etcd: each worker's agent metadata is stored under its instance
lease (`/<namespace>/nixl/<instance_id>`) and disappears with it.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from typing import TYPE_CHECKING

import numpy as np
import xxhash

from services.engines.base import EngineBusy, pull_deadline_s

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DONE_PREFIX = b"kvmesh-done:"
NOTIF_POLL_S = 0.005
TRANSFER_POLL_S = 0.0005


class KvTransferError(Exception):
    """The KV could not be moved (peer gone, transfer failed, or the bytes did not match)."""


def check_pull_adapter(params: dict, lora_name: str) -> None:
    """Refuses KV computed with another LoRA adapter than the request's ("" is the base model;
    parameters from before adapters name none)."""
    pulled = str(params.get("lora_name", ""))
    if pulled != lora_name:
        raise KvTransferError(f"the prefill worker computed this prompt's KV with {_model_of(pulled)}, "
                              f"but the request runs {_model_of(lora_name)}: refusing to pull it")


def _model_of(lora_name: str) -> str:
    return f"LoRA adapter {lora_name!r}" if lora_name else "the base model"


def nixl_metadata_key(namespace: str, instance_id: str) -> str:
    return f"/{namespace}/nixl/{instance_id}"


def _fill(region: torch.Tensor, tokens: list[int], bytes_per_token: int) -> int:
    """Writes KV bytes that depend on every token and its position into `region`, so a transfer of
    the wrong prompt cannot pass the checksum, and returns their checksum. Built at memory speed:
    a random row of words per request, each token's id mixed into its row's first word and its
    position into the last, written in place (a size that is no whole number of words is built
    beside and cut to `bytes_per_token` a row)."""
    ids = np.asarray(tokens, dtype="<u4")
    words = -(-bytes_per_token // 4)
    aligned = words * 4 == bytes_per_token
    out = region.numpy()
    kv = out.view(np.uint32).reshape(len(tokens), words) if aligned else np.empty((len(tokens), words), np.uint32)
    kv[:] = np.random.default_rng(xxhash.xxh3_64_intdigest(ids.tobytes())).integers(0, 2**32, size=words,
                                                                                     dtype=np.uint32)
    kv[:, 0] ^= ids
    kv[:, -1] += np.arange(len(tokens), dtype=np.uint32)
    if not aligned:
        out.reshape(len(tokens), bytes_per_token)[:] = kv.view(np.uint8)[:, :bytes_per_token]
    return checksum(region)


def tokens_digest(tokens: list[int]) -> int:
    """What the held KV was computed for: a puller checks it against its own tokens, so KV held
    for another sequence (or a shorter one) is refused before it is decoded from."""
    return xxhash.xxh3_64_intdigest(np.asarray(tokens, dtype="<u4").tobytes())


def check_pull_tokens(params: dict, tokens: list[int]) -> None:
    """Refuses KV held for other tokens than the request's (parameters from before this check
    name none)."""
    held = params.get("tokens")
    if held is not None and (held != len(tokens) or params.get("tokens_digest") != tokens_digest(tokens)):
        raise KvTransferError(f"the KV held by {params.get('agent')} is for other tokens ({held}) than the "
                              f"request's ({len(tokens)}): refusing to pull it")


def checksum(buffer: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(buffer.numpy().data)


class Arena:
    """A registered buffer handed out in slices (first fit, coalescing frees)."""

    def __init__(self, nbytes: int) -> None:
        import torch

        self.buffer = torch.zeros(nbytes, dtype=torch.uint8)
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, size), sorted by offset

    def alloc(self, size: int) -> int | None:
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                return offset
        return None

    def release(self, offset: int, size: int) -> None:
        self._free.append((offset, size))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for start, length in self._free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self._free = merged

    def view(self, offset: int, size: int) -> torch.Tensor:
        return self.buffer[offset : offset + size]


@dataclass(frozen=True)
class _Transfer:
    """A READ this agent started: its NIXL handle and the slice of the arena it writes into."""

    handle: object
    offset: int
    nbytes: int
    peer: str


@dataclass
class _Held:
    offset: int
    size: int
    expires_at: float
    # Called once the hold ends (pulled, released or expired): a moved request's blocks go then.
    on_release: Callable[[], None] | None = None


class NixlKvEndpoint:
    """One NIXL agent per mocker worker; prefill workers hold KV, decode workers pull it."""

    def __init__(self, agent_name: str, bytes_per_token: int,
                 metadata_lookup: Callable[[str], Awaitable[bytes | None]] | None = None,
                 arena_bytes: int = 256 << 20, hold_timeout_s: float = 60.0) -> None:
        """`metadata_lookup` finds a peer agent's NIXL metadata by its name (decode side)."""
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = agent_name
        self.bytes_per_token = bytes_per_token
        self._hold_timeout_s = hold_timeout_s
        # No progress thread: NIXL's polls without sleeping (a core per idle worker). A transfer
        # is driven by the reader's own state checks, and the holder's memory is read one-sided.
        self._agent = nixl_agent(agent_name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        # Registered before the metadata is published: peers learn the memory with the agent.
        self._arena = Arena(arena_bytes)
        self._registration = self._agent.register_memory(self._arena.buffer)
        self._held: dict[str, _Held] = {}
        self._peers: set[str] = set()
        # READs NIXL would not release yet (cut off mid-way), with their arena slices.
        self._unreleased: list[_Transfer] = []
        self._task: asyncio.Task[None] | None = None
        self.metadata_lookup = metadata_lookup

    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def start(self) -> None:
        self._task = asyncio.create_task(self._reap(), name=f"nixl-reaper-{self.name}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for request_id in list(self._held):
            self.release(request_id)
        self._agent.deregister_memory(self._registration)

    # -- prefill side --------------------------------------------------------------------------

    async def hold(self, request_id: str, tokens: list[int], lora_name: str = "",
                   bytes_per_token: int | None = None, *, expires_s: float | None = None,
                   on_release: Callable[[], None] | None = None, with_metadata: bool = False) -> dict:
        """Writes the prompt's KV (computed with LoRA adapter `lora_name`) into the arena and
        returns what a decode worker needs to read it. `bytes_per_token`: another size than the
        KV's (an image's features, held by an encode worker). `expires_s`: how long it waits for
        its pull (default: the endpoint's hold timeout); `on_release`: called once it ends.
        `with_metadata`: the parameters carry this agent's NIXL metadata (a draining worker's
        handoff: its etcd record, where peers find the metadata, is gone already).

        Building and checksumming megabytes runs on a worker thread, off the engine's event loop.
        """
        per_token = bytes_per_token or self.bytes_per_token
        nbytes = len(tokens) * per_token
        offset = self._arena.alloc(nbytes)
        if offset is None:
            raise EngineBusy(f"no room to hold {nbytes} KV bytes for a decode worker to pull (all "
                             f"{self._arena.buffer.numel()} held for earlier prompts)")
        region = self._arena.view(offset, nbytes)
        try:
            digest = await asyncio.to_thread(_fill, region, tokens, per_token)
        except BaseException:
            self._arena.release(offset, nbytes)
            raise
        timeout = self._hold_timeout_s if expires_s is None else expires_s
        self._held[request_id] = _Held(offset, nbytes, time.monotonic() + timeout, on_release)
        descs = self._agent.get_serialized_descs(self._agent.get_xfer_descs(region))
        params = {"agent": self.name, "request_id": request_id, "nbytes": nbytes, "checksum": digest,
                  "descs": base64.b64encode(descs).decode(), "lora_name": lora_name,
                  "tokens": len(tokens), "tokens_digest": tokens_digest(tokens)}
        if with_metadata:
            params["agent_metadata"] = base64.b64encode(self.metadata()).decode()
        return params

    def release(self, request_id: str) -> bool:
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        self._arena.release(held.offset, held.size)
        if held.on_release is not None:
            held.on_release()
        return True

    @property
    def held_requests(self) -> int:
        return len(self._held)

    async def _reap(self) -> None:
        """Frees KV its decode side finished reading, and KV nobody came for in time."""
        while True:
            for messages in self._agent.get_new_notifs().values():
                for message in messages:
                    if message.startswith(DONE_PREFIX):
                        self.release(message[len(DONE_PREFIX):].decode())
            now = time.monotonic()
            for request_id in [r for r, h in self._held.items() if h.expires_at < now]:
                log.warning("KV of %s was never pulled; released after %.0fs", request_id, self._hold_timeout_s)
                self.release(request_id)
            await asyncio.sleep(NOTIF_POLL_S)

    # -- decode side ---------------------------------------------------------------------------

    async def pull(self, params: dict, timeout_s: float | None = None) -> tuple[int, float]:
        """Reads a prefill worker's KV into local memory within `timeout_s` (default: by its size),
        finding the peer and checking the bytes included; returns (bytes, seconds)."""
        nbytes = int(params["nbytes"])
        deadline = time.perf_counter() + (pull_deadline_s(nbytes) if timeout_s is None else timeout_s)
        self._retry_releases()
        peer = params["agent"]
        try:
            await asyncio.wait_for(self._connect(peer, params.get("agent_metadata")), deadline - time.perf_counter())
        except TimeoutError:
            raise KvTransferError(f"prefill worker {peer}'s NIXL metadata not found in time") from None
        offset = self._arena.alloc(nbytes)
        if offset is None:
            raise KvTransferError(f"no room to receive {nbytes} KV bytes")
        local = self._arena.view(offset, nbytes)
        started = time.perf_counter()
        handle = None
        try:
            remote = self._agent.deserialize_descs(base64.b64decode(params["descs"]))
            notif = DONE_PREFIX + params["request_id"].encode()
            handle = self._agent.initialize_xfer("READ", self._agent.get_xfer_descs(local), remote, peer, notif)
            if self._agent.transfer(handle) == "ERR":
                raise KvTransferError(f"NIXL refused the transfer from {peer}")
            while (state := self._agent.check_xfer_state(handle)) != "DONE":
                if state == "ERR" or time.perf_counter() > deadline:
                    raise KvTransferError(f"NIXL transfer from {peer} {'failed' if state == 'ERR' else 'timed out'}")
                await asyncio.sleep(TRANSFER_POLL_S)
            seconds = time.perf_counter() - started
            # The check runs past the deadline only by its own length: a thread cannot be stopped.
            if await asyncio.to_thread(checksum, local) != params["checksum"]:
                raise KvTransferError(f"KV from {peer} arrived corrupted (checksum mismatch)")
            return nbytes, seconds
        finally:
            # The engine's "KV cache" is simulated: the received bytes need not outlive the check.
            self._release(_Transfer(handle, offset, nbytes, peer))

    def _release(self, transfer: _Transfer, retry: bool = False) -> None:
        """Releases a transfer and its slice of the arena. NIXL refuses to release one still in
        flight (to a peer cut off mid-way): bytes may still land in its slice, so both are kept and
        released by a later pull, once NIXL lets go."""
        if transfer.handle is not None:
            try:
                self._agent.release_xfer_handle(transfer.handle)
            except Exception as exc:  # noqa: BLE001 - nixl raises its own error types per status
                if not retry:
                    log.warning("NIXL transfer from %s could not be released yet (%s); its receive buffer stays "
                                "taken until it can be", transfer.peer, exc)
                self._unreleased.append(transfer)
                return
        self._arena.release(transfer.offset, transfer.nbytes)

    def _retry_releases(self) -> None:
        pending, self._unreleased = self._unreleased, []
        for transfer in pending:
            self._release(transfer, retry=True)

    async def _connect(self, peer: str, inline: str | None = None) -> None:
        """Knows `peer`'s agent from here on: by the metadata the pull carries (`inline`, base64),
        else by its record in etcd."""
        if peer in self._peers:
            return
        if inline is not None:
            metadata: bytes | None = base64.b64decode(inline)
        elif self.metadata_lookup is None:
            raise KvTransferError("no NIXL metadata store configured")
        else:
            metadata = await self.metadata_lookup(peer)
        if metadata is None:
            raise KvTransferError(f"prefill worker {peer} has no NIXL metadata in etcd (gone?)")
        self._agent.add_remote_agent(metadata)
        self._peers.add(peer)
