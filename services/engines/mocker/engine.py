"""The mocker engine: continuous batching over a real block manager, with simulated step times.

No weights: the token at each position is a hash (output_tokens.py), so every worker produces
the same continuation and a request moved mid-stream goes on exactly. Everything else —
admission under a token budget, prefix-cache hits, eviction, preemption when the cache is full,
KV events and load — is real bookkeeping.

Agent sessions (`EngineRequest.session`): a session's blocks are pinned between its requests,
within `MockerConfig.session_pin_blocks` on the device and else protected in the host tier, and
brought back from the host tier as its next request arrives (session_pins.py).

LoRA adapters (`MockerConfig.lora`): a request holds its adapter (`AdapterSet.use`) for its whole
life; a load stalls the engine's step (adapter_loads.py). An adapter's blocks are hashed with its
seed (`adapter_seed`), so its cache never serves the base model or another adapter.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncGenerator, Collection
from contextlib import AsyncExitStack
from dataclasses import replace

from services.kv_protocol.hashing import (
    adapter_seed,
    chain_from,
    chain_hash,
    local_block_hashes,
)
from services.engines.base import (
    EncodedImage,
    Engine,
    EngineInfo,
    EngineOutput,
    EngineRequest,
    FinishReason,
    LoadSnapshot,
    MediaInput,
    PrefillResult,
    RowTap,
)
from services.engines.lora import AdapterError, AdapterErrorKind, AdapterSet
from services.engines.mocker.adapter_loads import SimulatedAdapterLoader
from services.engines.mocker.block_manager import BlockManager
from services.engines.mocker.config import MockerConfig
from services.engines.mocker.encode_stage import EncodeStage, cached_prefix_tokens
from services.engines.mocker.encoder import ImageEncoder
from services.engines.model_facts import read_model_facts
from services.engines.output_channel import OutputChannel
from services.engines.mocker.output_tokens import OutputTokens
from services.engines.mocker.kv_transfer import KvTransferError, NixlKvEndpoint
from services.engines.mocker.load_terms import host_tier_load, prefill_cost
from services.engines.mocker.moves import MoveOut
from services.engines.mocker.request_checks import check_request
from services.engines.mocker.sequence import Seq
from services.engines.mocker.session_pins import SessionPins

log = logging.getLogger(__name__)


class MockerEngine(Engine):
    name = "mocker"

    def __init__(self, config: MockerConfig, kv_endpoint: NixlKvEndpoint | None = None) -> None:
        """`kv_endpoint`: the NIXL agent that moves prompt KV to and from peers (disaggregated
        serving); without one the engine serves aggregated only."""
        facts = read_model_facts(config.model_dir)
        self.config = config
        self.info = EngineInfo(config.model_dir, config.served_model_name, config.block_size,
                               config.max_model_len or facts.context_length, facts.vocab_size, facts.eos_token_ids)
        self._tokens = OutputTokens.of_vocab(facts.vocab_size)
        self.encoder = ImageEncoder(facts.vision)
        self._encode_stage = EncodeStage(self.encoder, kv_endpoint, config.timing, facts.hidden_size,
                                         self._cached_prefix_tokens)
        self.blocks = BlockManager(config.num_gpu_blocks, config.block_size, self.emit_kv_event,
                                   config.host_kv_blocks)
        # Half the host tier at most holds sessions' blocks: the rest stays a cache for everyone.
        self.sessions = SessionPins(self.blocks, config.pin_budget, config.host_kv_blocks // 2)
        # When the host -> device link is free of prefetches already started (engine clock).
        self._link_free_at = 0.0
        self._waiting: deque[Seq] = deque()
        self._running: list[Seq] = []
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._prompt_tokens_seen = 0
        self._prompt_tokens_hit = 0
        self.kv_endpoint = kv_endpoint
        self._moves = MoveOut(kv_endpoint, self.blocks.free)
        # Summing every running sequence's length each step only where the profile charges it.
        self._charges_context = config.timing.cost.decode_per_context_token_s > 0
        self._adapter_loads = SimulatedAdapterLoader(config.timing, self._wake.set)
        if config.lora.enabled:
            self.adapters = AdapterSet(config.lora, self._adapter_loads, clock=self._adapter_loads.clock)
            for module in config.lora.modules:
                self.adapters.register(module.name, module.path)

    async def start(self) -> None:
        self._loop_task = asyncio.create_task(self._step_loop(), name="mocker-steps")
        if self.kv_endpoint is not None:
            self.kv_endpoint.start()

    async def stop(self) -> None:
        if self.kv_endpoint is not None:
            await self.kv_endpoint.stop()
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        self._adapter_loads.abort("the mocker engine stopped")
        for seq in list(self._running) + list(self._waiting):
            self._finish(seq, FinishReason.ABORT)

    async def check_health(self) -> None:
        task = self._loop_task
        if task is None:
            raise RuntimeError("the mocker is not started")
        if task.done():
            reason = "was cancelled" if task.cancelled() else f"died: {task.exception()!r}"
            raise RuntimeError(f"the mocker's step loop {reason}")

    def load(self) -> LoadSnapshot:
        total = self.config.num_gpu_blocks
        # Sessions' pinned blocks count as used: no new request can take them, and a router that
        # saw that room free would send work here only for it to wait.
        active = self.blocks.active_blocks + self.blocks.idle_pinned_blocks
        seen = self._prompt_tokens_seen
        return LoadSnapshot(
            request_active_slots=len(self._running),
            request_total_slots=self.config.max_num_seqs,
            kv_active_blocks=active,
            kv_total_blocks=total,
            num_requests_waiting=len(self._waiting),
            gpu_cache_usage_perc=active / total if total else 0.0,
            gpu_prefix_cache_hit_rate=self._prompt_tokens_hit / seen if seen else 0.0,
            host_tier=host_tier_load(self.config, self.blocks),
            prefill_cost=prefill_cost(self.config.timing),
            sessions=self.sessions.load(),
            images=self.encoder.load(),
        )

    async def prefill(self, request: EngineRequest) -> PrefillResult:
        if self.kv_endpoint is None:
            return await super().prefill(request)
        cached = 0
        one = EngineRequest(request.request_id, request.token_ids, replace(request.sampling, max_tokens=1),
                            lora_name=request.lora_name, media=request.media)
        async for out in self.generate(one):
            cached = out.cached_tokens
        params = await self.kv_endpoint.hold(request.request_id, request.token_ids, request.lora_name)
        return PrefillResult(params, cached)

    def to_encode(self, request: EngineRequest) -> list[MediaInput]:
        return self._encode_stage.to_encode(request)

    async def encode(self, request_id: str, item: MediaInput) -> EncodedImage:
        return await self._encode_stage.encode(request_id, item)

    async def take_features(self, item: MediaInput, features: dict) -> None:
        await self._encode_stage.take_features(item, features)

    def _cached_prefix_tokens(self, request: EngineRequest) -> int:
        return cached_prefix_tokens(request, self.config.block_size, adapter_seed(request.lora_name),
                                    self.blocks.reusable_prefix_blocks)

    async def release_kv(self, request_id: str) -> bool:
        return self.kv_endpoint is not None and self.kv_endpoint.release(request_id)

    @property
    def can_move(self) -> bool:
        return self.kv_endpoint is not None

    async def move_out(self, request_ids: Collection[str] | None = None) -> int:
        seqs = await self._moves.take(self._wake.set, request_ids)
        await self._moves.hand_over(seqs)
        return len(seqs)

    def moves_unpulled(self) -> int:
        return self._moves.unpulled

    async def generate(self, request: EngineRequest, tap: RowTap | None = None) -> AsyncGenerator[EngineOutput, None]:
        self._check(request)
        seq = Seq(
            request=request,
            tokens=list(request.token_ids),
            prompt_len=len(request.token_ids),
            digest=OutputTokens.digest(request),
            out=OutputChannel(request.sampling.max_tokens + 1, tap),
            hash_seed=adapter_seed(request.lora_name),
        )
        async with AsyncExitStack() as held:
            if request.lora_name:
                # Held until the request ends: its adapter cannot be unloaded under it.
                await held.enter_async_context(self._adapter_set().use(request.lora_name))
            if request.kv_pull is not None:
                if self.kv_endpoint is None:
                    raise KvTransferError("this worker was started without KV transfer (--kv-transfer nixl)")
                self.record_kv_transfer(*await self.kv_endpoint.pull(request.kv_pull))
                seq.remote_kv = True
            if request.session is not None and not seq.remote_kv:
                self._prefetch(seq)
            # A request moved here mid-stream with its KV was running: it goes before new prompts.
            (self._waiting.appendleft if seq.remote_kv and request.resumed_tokens else self._waiting.append)(seq)
            self._wake.set()
            try:
                while True:
                    output = await seq.out.get()
                    yield output
                    if output.finish_reason is not None:
                        return
            finally:
                if not seq.done:
                    self._finish(seq, FinishReason.ABORT)

    def _prefetch(self, seq: Seq) -> None:
        """A session's request arrived: its prefix in host memory starts moving to the device now,
        so the transfer overlaps its wait in the queue (the link carries one prefetch at a time)."""
        session = seq.request.session
        assert session is not None
        self._hash_prompt(seq)
        now = asyncio.get_running_loop().time()
        loaded = self.sessions.arrived(session.session_id, seq.chain, session.retain_s, now)
        if loaded:
            nbytes = loaded * self.config.block_size * self.config.kv_bytes_per_token
            self._link_free_at = max(now, self._link_free_at) + self.config.timing.load_seconds(
                nbytes, self.config.host_kv_gbps)
            seq.kv_ready_at = self._link_free_at

    def _hash_prompt(self, seq: Seq) -> None:
        bs = self.config.block_size
        if not seq.chain and len(seq.tokens) >= bs:
            seq.locals_ = local_block_hashes(seq.tokens, bs, seq.hash_seed, seq.request.spans())
            seq.chain = chain_from(seq.locals_)

    def _check(self, request: EngineRequest) -> None:
        """Refuses a request this engine cannot serve as asked, before it takes anything."""
        check_request(request, self.info, self.config, self.encoder, self._adapter_set)

    def _adapter_set(self) -> AdapterSet:
        if self.adapters is None:
            raise AdapterError(AdapterErrorKind.DISABLED,
                               "this worker was started without LoRA (--enable-lora): it serves the base model only")
        return self.adapters

    # -- scheduling ----------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        step_end: float | None = None
        while True:
            self._moves.at_boundary(self._running, self._waiting)  # a drain's move_out, between steps
            self.sessions.expire(loop.time())  # a heap peek, nothing when no pin is due
            if not self._waiting and not self._running and not self._adapter_loads.queued:
                self._wake.clear()
                step_end = None  # idle: the next step starts its own clock
                # Idle with pins: woken by their next expiry too, so it is not left to the next request.
                expiry = self.sessions.next_expiry()
                try:
                    async with asyncio.timeout_at(expiry):
                        await self._wake.wait()
                except TimeoutError:
                    continue
            decode_seqs = len(self._running)
            context = sum(len(seq.tokens) for seq in self._running) if self._charges_context else 0
            admitted, prompts, loaded_blocks, kv_ready_at, patches = self._admit()
            timing = self.config.timing
            # Adapters load while the step is set up: every sequence in it waits for them; so do
            # the images its prompts encode.
            duration = (timing.step_seconds(prompts, decode_seqs, context) + self._adapter_loads.start_step()
                        + timing.encode_seconds(patches))
            if loaded_blocks:
                kv_bytes = loaded_blocks * self.config.block_size * self.config.kv_bytes_per_token
                duration += timing.load_seconds(kv_bytes, self.config.host_kv_gbps)
            now = loop.time()
            if kv_ready_at:  # a prefetch not done yet by this step's start holds the step for the rest
                duration += max(0.0, kv_ready_at - (now if step_end is None else max(now, step_end)))
            # Back-to-back steps keep the engine's own clock: a step ends `duration` after the
            # previous one ended, not after this process got round to starting it, so time the
            # event loop spent elsewhere (streaming the last step's tokens) does not stretch the
            # step, as it would not on an accelerator. More than a step behind, it restarts at now.
            if step_end is None or step_end + duration < now:
                step_end = now + duration
            else:
                step_end += duration
            await asyncio.sleep(max(0.0, step_end - now))
            self._adapter_loads.end_step()
            self._emit_tokens(admitted)

    def _admit(self) -> tuple[list[Seq], list[int], int, float, list[int]]:
        """Admits waiting sequences; returns them, the uncached tokens of each prompt the step
        computes, the blocks it loads back from the host tier, when the last of their prefetches
        is done (0.0: none pending), and the patches of each image it encodes."""
        admitted: list[Seq] = []
        budget = self.config.max_num_batched_tokens
        used = loaded = 0
        ready_at = 0.0
        prompts: list[int] = []
        patches: list[int] = []
        while self._waiting and len(self._running) + len(admitted) < self.config.max_num_seqs:
            seq = self._waiting[0]
            bs = self.config.block_size
            self._hash_prompt(seq)
            chain = seq.chain
            if seq.remote_kv:
                uncached = 0
            else:
                uncached = len(seq.tokens) - self.blocks.reusable_prefix_blocks(chain) * bs
            # A prompt longer than the budget runs alone in its step (chunked prefill, collapsed).
            if used and used + uncached > budget:
                break
            allocation = self.blocks.allocate(chain, seq.locals_, len(seq.tokens), seq.request.lora_name)
            # Nothing running will free blocks: pins give way rather than leave the queue stuck.
            while allocation is None and not self._running and not admitted and self.sessions.yield_device():
                allocation = self.blocks.allocate(chain, seq.locals_, len(seq.tokens), seq.request.lora_name)
            if allocation is None:
                break
            self._waiting.popleft()
            if seq.request.session is not None:
                self.sessions.started(seq.request.session.session_id)
                ready_at = max(ready_at, seq.kv_ready_at)
            seq.blocks, hit_blocks, host_blocks = allocation
            reused = hit_blocks + host_blocks
            if seq.generated == 0:
                seq.cached_tokens = min(reused * bs, seq.prompt_len)
                self._prompt_tokens_seen += seq.prompt_len
                self._prompt_tokens_hit += seq.cached_tokens
            if not seq.remote_kv:
                patches += self.encoder.step_patches(seq.request.media, reused * bs)
                computed = len(seq.tokens) - reused * bs
                if computed > 0:
                    prompts.append(computed)
                used += computed
                loaded += host_blocks
            admitted.append(seq)
        return admitted, prompts, loaded, ready_at, patches

    def _emit_tokens(self, admitted: list[Seq]) -> None:
        running = self._running
        running.extend(admitted)
        still: list[Seq] = []
        for seq in running:
            if seq.done:
                continue
            if not self._grow(seq) and not self._grow_past_pins(seq):
                self._preempt(seq)
                continue
            position = seq.request.resumed_tokens + seq.generated
            ends = seq.answer_ends(position, self.config.answer_tokens)
            token = self.info.eos_token_ids[0] if ends and self.info.eos_token_ids else self._tokens.at(seq.digest,
                                                                                                     position)
            seq.tokens.append(token)
            seq.generated += 1
            finish = seq.finish_reason(token) or (FinishReason.STOP if ends else None)
            seq.out.put(EngineOutput([token], finish, seq.cached_tokens))
            if finish is None:
                still.append(seq)
            else:
                self._release(seq)
        self._running = still

    def _grow(self, seq: Seq) -> bool:
        """Makes room for one more token; caches the block the previous token filled."""
        bs = self.config.block_size
        n = len(seq.tokens)
        if n % bs == 0 and n // bs > len(seq.chain):
            parent = seq.chain[-1] if seq.chain else None
            local = local_block_hashes(seq.tokens[n - bs : n], bs, seq.hash_seed, seq.request.spans(), n - bs)[0]
            seq.chain.append(chain_hash(parent or 0, local))
            seq.locals_.append(local)
            self.blocks.cache_block(seq.blocks[n // bs - 1], parent, seq.chain[-1], local, seq.request.lora_name)
        if n + 1 > len(seq.blocks) * bs:
            block = self.blocks.append_block()
            if block is None:
                return False
            seq.blocks.append(block)
        return True

    def _grow_past_pins(self, seq: Seq) -> bool:
        """Out of blocks: pins give way, least recently active first, before a sequence is preempted."""
        while self.sessions.yield_device():
            if self._grow(seq):
                return True
        return False

    def _preempt(self, seq: Seq) -> None:
        """Out of blocks: give this sequence's back and recompute it later, as vLLM does."""
        log.debug("preempting %s", seq.request.request_id)
        self.blocks.free(seq.blocks)
        seq.blocks = []
        seq.remote_kv = False  # its pulled KV is gone with the blocks: recomputed on readmission
        self._waiting.appendleft(seq)

    def _release(self, seq: Seq) -> None:
        seq.done = True
        session = seq.request.session
        if session is not None and seq.blocks and seq.generated:
            # Pinned before the blocks are freed, so they never pass through the LRU.
            self.sessions.kept(session.session_id, seq.chain, session.retain_s, asyncio.get_running_loop().time())
        self.blocks.free(seq.blocks)
        seq.blocks = []

    def _finish(self, seq: Seq, reason: FinishReason) -> None:
        if seq.done:
            return
        if seq in self._running:
            self._running.remove(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        self._release(seq)
        if not seq.out.full():
            seq.out.put(EngineOutput([], reason, seq.cached_tokens))
