"""The mocker's paged KV cache: fixed-size blocks, prefix caching by chained hash, LRU eviction,
and an optional host-memory tier below it.

It behaves like vLLM's block pool where it matters to the router: a full block is cached under the
hash of its tokens and everything before it; blocks nobody references stay cached until space is
needed, and the least recently freed goes first. Every cache change is reported as a KV event.

The host tier (`host_blocks` > 0) keeps what the device evicts, as vLLM's CPU offloading and
Dynamo's KVBM do: an evicted block moves to host memory (least recently moved leaves first, for
good); a prompt whose prefix continues in host memory loads those blocks back into fresh device
blocks instead of recomputing them. A block lives in one tier at a time. Events keep the router's
view whole at every step: a block is stored in its new tier before it is removed from the old one,
so no index node is ever left empty in between (an empty node would drop everything below it).
A block is moved to host only while its parent is still cached somewhere: a block whose prefix is
gone can never be hit again.

Session pins (session_pins.py decides what to pin; this module keeps the rules of a pinned block):
a pinned device block is cached and, while nobody references it, neither free nor evictable: it
stays off the LRU, so `allocate` fails rather than evict it (the pin budget keeps pins from
crowding out running requests; the engine demotes pins when nothing else can make progress). A
pin is always a run of a chain from its root, so a pinned block's parent is pinned too. A
protected host block is kept out of the host tier's LRU drop; protection too covers runs from the
root, so a protected block's parent is never dropped from host memory under it. Unpinned and
unprotected blocks join their LRU at the newest end, children before parents, so a chain still
leaves each tier tail first.

LoRA adapters: the engine hashes an adapter's blocks with the adapter's seed (`adapter_seed`), so
their chained hashes differ from the base model's and every other adapter's and a lookup here
never matches across adapters. Each cached block remembers its adapter, in both tiers, only so
that its KvStored events can name it (`lora_name`).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Container, Sequence

from services.kv_protocol.events import KvEventData, KvRemoved, KvStored
from services.kv_protocol.tier import Tier
from services.kv_protocol.hashing import LocalBlockHash, SequenceHash

# Marks a block that caches nothing; sequence hashes are u64, never negative.
NO_HASH = SequenceHash(-1)
# A block that left the device: its hash, its parent's hash, its local hash and its LoRA adapter.
_Evicted = tuple[SequenceHash, SequenceHash | None, LocalBlockHash, str]
# What the host tier keeps of a block: its parent's hash, its local hash and its LoRA adapter.
_HostEntry = tuple[SequenceHash | None, LocalBlockHash, str]


def _run_held(held: Container[SequenceHash], chain: Sequence[SequenceHash], start: int) -> int:
    """How many blocks of `chain`, from `start` on, `held` has without a gap."""
    n = 0
    for h in itertools.islice(chain, start, None):
        if h not in held:
            break
        n += 1
    return n


def _parents_first(batch: list[_Evicted]) -> list[_Evicted]:
    """The batch ordered so that a block whose parent is also in it comes after that parent."""
    by_hash = {entry[0]: entry for entry in batch}
    done: set[SequenceHash] = set()
    out: list[_Evicted] = []
    for entry in reversed(batch):  # tail-first evictions reversed: mostly in order already
        stack, on_stack = [entry], {entry[0]}
        while stack:
            h, parent, _, _ = stack[-1]
            if parent in by_hash and parent not in done and parent not in on_stack:
                stack.append(by_hash[parent])
                on_stack.add(parent)
                continue
            stack.pop()
            if h not in done:
                done.add(h)
                out.append(by_hash[h])
    return out


class BlockManager:
    __slots__ = (
        "_by_hash",
        "_emit",
        "_hash_of",
        "_host",
        "_host_lru",
        "_idle_pinned",
        "_local_of",
        "_lora_of",
        "_lru",
        "_never_used",
        "_parent_of",
        "_pins",
        "_protect",
        "_refs",
        "block_size",
        "host_blocks",
        "host_hit_blocks",
        "num_blocks",
        "pinned_blocks",
    )

    def __init__(self, num_blocks: int, block_size: int, emit: Callable[[KvEventData], None],
                 host_blocks: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.host_blocks = host_blocks
        self._emit = emit
        self._never_used: list[int] = list(range(num_blocks - 1, -1, -1))
        self._by_hash: dict[SequenceHash, int] = {}
        self._hash_of: list[SequenceHash] = [NO_HASH] * num_blocks
        # What a cached device block needs to move to host: its parent's hash and its local hash.
        self._parent_of: list[SequenceHash | None] = [None] * num_blocks
        self._local_of: list[LocalBlockHash] = [LocalBlockHash(0)] * num_blocks
        self._lora_of: list[str] = [""] * num_blocks
        self._refs: list[int] = [0] * num_blocks
        # Cached blocks with no reference, oldest first: the eviction order.
        self._lru: OrderedDict[int, None] = OrderedDict()
        # The host tier: block hash -> (parent hash, local hash, adapter); and those of its blocks
        # that may be dropped (not protected by a session), oldest first: the drop order.
        self._host: dict[SequenceHash, _HostEntry] = {}
        self._host_lru: OrderedDict[SequenceHash, None] = OrderedDict()
        self.host_hit_blocks = 0
        # Session pins on each device block; blocks with a pin, and those of them nobody references.
        self._pins: list[int] = [0] * num_blocks
        self.pinned_blocks = 0
        self._idle_pinned = 0
        # Session protections on each host-tier hash (whether the block is in host memory yet or not).
        self._protect: dict[SequenceHash, int] = {}

    # -- queries -------------------------------------------------------------------------------

    @property
    def active_blocks(self) -> int:
        """Blocks running requests hold (pinned blocks nobody references are not counted)."""
        return self.num_blocks - len(self._never_used) - len(self._lru) - self._idle_pinned

    @property
    def idle_pinned_blocks(self) -> int:
        """Pinned blocks no running request references: a session's kept history."""
        return self._idle_pinned

    @property
    def free_blocks(self) -> int:
        return len(self._never_used) + len(self._lru)

    @property
    def host_active_blocks(self) -> int:
        return len(self._host)

    @property
    def host_protected_blocks(self) -> int:
        """Host-tier blocks a session protects from the drop."""
        return len(self._host) - len(self._host_lru)

    def cached_prefix_blocks(self, chain: Sequence[SequenceHash]) -> int:
        return _run_held(self._by_hash, chain, 0)

    def host_prefix_blocks(self, chain: Sequence[SequenceHash], start: int) -> int:
        """How many blocks of `chain` from `start` on continue the prefix in host memory."""
        return _run_held(self._host, chain, start) if self._host else 0

    def reusable_prefix_blocks(self, chain: Sequence[SequenceHash]) -> int:
        """The blocks of `chain`'s prefix a prompt need not compute: cached on the device, then
        continuing in host memory."""
        hit = self.cached_prefix_blocks(chain)
        return hit + self.host_prefix_blocks(chain, hit)

    # -- allocation ----------------------------------------------------------------------------

    def allocate(self, chain: list[SequenceHash], locals_: list[LocalBlockHash],
                 num_tokens: int, lora_name: str = "") -> tuple[list[int], int, int] | None:
        """Blocks for a sequence of `num_tokens` whose full blocks hash to `chain` (computed with
        LoRA adapter `lora_name`, "" for the base model).

        Reuses the cached prefix, loads the part of it that continues in host memory back into
        fresh blocks, takes fresh blocks for the rest and caches the new full ones. Returns
        (block ids, device-cached blocks, blocks loaded from host) or None when the cache cannot
        hold it now.
        """
        hit = self.cached_prefix_blocks(chain)
        needed = -(-num_tokens // self.block_size) - hit
        reusable_from_lru = sum(1 for h in chain[:hit] if self._by_hash[h] in self._lru)
        if needed > self.free_blocks - reusable_from_lru:
            return None
        blocks = [self._ref_cached(self._by_hash[h]) for h in chain[:hit]]
        # Taken out of the host tier before any eviction below can push them out of it.
        loaded = [chain[i] for i in range(hit, hit + self.host_prefix_blocks(chain, hit))]
        for h in loaded:
            del self._host[h]
            self._host_lru.pop(h, None)
        evicted: list[_Evicted] = []
        for _ in range(needed):
            blocks.append(self._take_block(evicted))
        self._evict(evicted)
        self._cache_full_blocks(blocks, chain, locals_, hit, lora_name)
        if loaded:  # on the device now (stored above): the host copies go
            self.host_hit_blocks += len(loaded)
            self._emit(KvRemoved(tuple(loaded), Tier.HOST))
        return blocks, hit, len(loaded)

    def append_block(self) -> int | None:
        """One more block for a growing sequence, or None when every block is referenced."""
        if self.free_blocks == 0:
            return None
        evicted: list[_Evicted] = []
        block = self._take_block(evicted)
        self._evict(evicted)
        return block

    def cache_block(self, block: int, parent_hash: SequenceHash | None, chain_hash: SequenceHash,
                    local_hash: LocalBlockHash, lora_name: str = "") -> None:
        """Marks a block that just became full (during decode) as cached."""
        if chain_hash in self._by_hash or self._hash_of[block] != NO_HASH:
            return
        self._by_hash[chain_hash] = block
        self._hash_of[block] = chain_hash
        self._parent_of[block] = parent_hash
        self._local_of[block] = local_hash
        self._lora_of[block] = lora_name
        self._emit(KvStored(parent_hash, ((chain_hash, local_hash),), lora_name=lora_name))
        if self._host.pop(chain_hash, None) is not None:
            self._host_lru.pop(chain_hash, None)
            self._emit(KvRemoved((chain_hash,), Tier.HOST))

    def free(self, blocks: list[int]) -> None:
        """Drops one reference to each block; cached ones stay reusable until evicted."""
        for block in reversed(blocks):
            refs = self._refs[block] - 1
            self._refs[block] = refs
            if refs:
                continue
            if self._hash_of[block] == NO_HASH:
                self._never_used.append(block)
            elif self._pins[block]:
                self._idle_pinned += 1  # kept by a session: off the LRU
            else:
                self._lru[block] = None

    # -- session pins --------------------------------------------------------------------------

    def pin(self, chain: Sequence[SequenceHash]) -> list[int]:
        """Pins the run of `chain` cached on the device from its root; returns the pinned blocks."""
        blocks: list[int] = []
        for h in chain:
            block = self._by_hash.get(h)
            if block is None:
                break
            blocks.append(block)
            pins = self._pins[block]
            self._pins[block] = pins + 1
            if not pins:
                self.pinned_blocks += 1
                if not self._refs[block]:
                    del self._lru[block]
                    self._idle_pinned += 1
        return blocks

    def unpin(self, blocks: Sequence[int]) -> None:
        """Drops one pin from each block; one nobody else keeps becomes evictable again, tail first."""
        for block in reversed(blocks):
            pins = self._pins[block] - 1
            self._pins[block] = pins
            if not pins:
                self.pinned_blocks -= 1
                if not self._refs[block]:
                    self._idle_pinned -= 1
                    self._lru[block] = None

    def protect(self, chain: Sequence[SequenceHash]) -> None:
        """Keeps `chain` (a run from its root), whatever of it is or comes to be in the host tier,
        out of the host tier's drop until `unprotect`."""
        protect, host_lru = self._protect, self._host_lru
        for h in chain:
            count = protect.get(h, 0)
            protect[h] = count + 1
            if not count:
                host_lru.pop(h, None)

    def unprotect(self, chain: Sequence[SequenceHash]) -> None:
        protect, host_lru = self._protect, self._host_lru
        for h in reversed(chain):  # children first: a chain still leaves host memory tail first
            count = protect[h] - 1
            if count:
                protect[h] = count
                continue
            del protect[h]
            if h in self._host:
                host_lru[h] = None

    def prefetch(self, chain: list[SequenceHash], max_blocks: int) -> int:
        """Loads up to `max_blocks` of the part of `chain`'s prefix that continues in host memory
        back onto the device ahead of its request's admission; returns how many. Only into blocks
        free now: it never waits, and the device prefix it continues is held while room is made."""
        hit = self.cached_prefix_blocks(chain)
        n = min(self.host_prefix_blocks(chain, hit), max_blocks)
        if n <= 0:
            return 0
        n = min(n, self.free_blocks - sum(1 for h in chain[:hit] if self._by_hash[h] in self._lru))
        if n <= 0:
            return 0
        held = [self._ref_cached(self._by_hash[h]) for h in chain[:hit]]
        loaded = chain[hit:hit + n]
        entries = [self._host.pop(h) for h in loaded]  # out before an eviction below could drop them
        for h in loaded:
            self._host_lru.pop(h, None)
        evicted: list[_Evicted] = []
        blocks = [self._take_block(evicted) for _ in range(n)]
        self._evict(evicted)
        for block, h, (parent, local, lora) in zip(blocks, loaded, entries, strict=True):
            self._by_hash[h] = block
            self._hash_of[block] = h
            self._parent_of[block] = parent
            self._local_of[block] = local
            self._lora_of[block] = lora
        # One chain, one adapter: stored on the device before the host copies are removed.
        self._emit(KvStored(entries[0][0], tuple((h, e[1]) for h, e in zip(loaded, entries, strict=True)),
                            lora_name=entries[0][2]))
        self._emit(KvRemoved(tuple(loaded), Tier.HOST))
        self.host_hit_blocks += n
        self.free(held + blocks)
        return n

    # -- internals -----------------------------------------------------------------------------

    def _ref_cached(self, block: int) -> int:
        refs = self._refs[block]
        if not refs:
            if self._pins[block]:
                self._idle_pinned -= 1
            else:
                self._lru.pop(block, None)
        self._refs[block] = refs + 1
        return block

    def _take_block(self, evicted: list[_Evicted]) -> int:
        if self._never_used:
            block = self._never_used.pop()
        else:
            block, _ = self._lru.popitem(last=False)
            old = self._hash_of[block]
            del self._by_hash[old]
            self._hash_of[block] = NO_HASH
            evicted.append((old, self._parent_of[block], self._local_of[block], self._lora_of[block]))
        self._refs[block] = 1
        return block

    def _evict(self, evicted: list[_Evicted]) -> None:
        """Reports blocks that left the device, first moving them to the host tier if there is one."""
        if not evicted:
            return
        if self.host_blocks:
            self._to_host(evicted)
        self._emit(KvRemoved(tuple(h for h, _, _, _ in evicted)))

    def _to_host(self, evicted: list[_Evicted]) -> None:
        """Keeps blocks the device evicted in host memory, stored there before the device removal is
        reported; room is made by dropping the host tier's oldest blocks for good. One stored event
        per chain, parents first (an engine evicts a chain tail first)."""
        host, host_lru, protect = self._host, self._host_lru, self._protect
        kept: list[_Evicted] = []
        present = {h for h, _, _, _ in evicted}
        for entry in _parents_first(evicted):
            parent = entry[1]
            if parent is None or parent in self._by_hash or parent in host or parent in present:
                kept.append(entry)
            else:
                present.discard(entry[0])  # its prefix is gone: it could never be hit again
        # More than the tier can take (protected blocks cannot make room): the chain heads stay.
        kept = kept[:self.host_blocks - (len(host) - len(host_lru))]
        dropped = [host_lru.popitem(last=False)[0] for _ in range(len(host) + len(kept) - self.host_blocks)]
        for h in dropped:
            del host[h]
        if dropped:
            self._emit(KvRemoved(tuple(dropped), Tier.HOST))
            gone = set(dropped)  # a dropped block's children lose their prefix with it
            still: list[_Evicted] = []
            for entry in kept:
                if entry[1] in gone:
                    gone.add(entry[0])
                else:
                    still.append(entry)
            kept = still
        # A chain is one adapter's (its hashes are seeded with it), so one event names one adapter.
        chains: list[tuple[SequenceHash | None, str, list[tuple[SequenceHash, LocalBlockHash]]]] = []
        for block_hash, parent, local, lora in kept:
            if chains and chains[-1][2][-1][0] == parent and chains[-1][1] == lora:
                chains[-1][2].append((block_hash, local))
            else:
                chains.append((parent, lora, [(block_hash, local)]))
        for parent, lora, blocks in chains:
            self._emit(KvStored(parent, tuple(blocks), Tier.HOST, lora))
        # Children enter the LRU before their parents, so a chain leaves host memory tail first, as
        # it left the device: a head dropped before its tail would strand the tail.
        for block_hash, parent, local, lora in reversed(kept):
            host[block_hash] = (parent, local, lora)
            if block_hash not in protect:
                host_lru[block_hash] = None

    def _cache_full_blocks(self, blocks: list[int], chain: list[SequenceHash], locals_: list[LocalBlockHash],
                           start: int, lora_name: str) -> None:
        stored: list[tuple[SequenceHash, LocalBlockHash]] = []
        for i in range(start, len(chain)):
            h = chain[i]
            if h in self._by_hash:
                break
            block = blocks[i]
            self._by_hash[h] = block
            self._hash_of[block] = h
            self._parent_of[block] = chain[i - 1] if i > 0 else None
            self._local_of[block] = locals_[i]
            self._lora_of[block] = lora_name
            stored.append((h, locals_[i]))
        if stored:
            parent = chain[start - 1] if start > 0 else None
            self._emit(KvStored(parent, tuple(stored), lora_name=lora_name))
            # Recomputed although a copy sat in host memory past a gap in the prefix: one tier.
            stale = [h for h, _ in stored if self._host.pop(h, None) is not None] if self._host else []
            for h in stale:
                self._host_lru.pop(h, None)
            if stale:
                self._emit(KvRemoved(tuple(stale), Tier.HOST))
