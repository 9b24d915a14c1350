"""The block manager: the engine's host bookkeeping of slots, KV blocks and the prefix cache.

Owns: `SlotAllocator` (LIFO, so freeing in reverse allocation order reproduces the same layout),
`BlockAllocator` (a free list of physical blocks), and `BlockManager`, one engine's slots, trunk
and drafter KV blocks, their reservations and, with prefix caching, its `PrefixCache`: which
blocks a sequence holds, shares or caches, and which snapshot slot a prefix's state goes to.
The device copies those decisions call for (restore or take a snapshot) are the engine's.

Invariants:
- Pure host state: this module imports no JAX and no NumPy (tests/test_blocks.py checks it).
- A slot or an own block is held by at most one live sequence; a cached block by as many as
  reference it (`prefix_cache.BlockCache`), and is freed only through eviction.
- Allocation is all-or-nothing: a refused request (`EngineError`) changes no sequence, no free
  list and no reference count; freeing twice is an error.
- A sequence never holds fewer blocks than its positions need: `reserve` runs before every
  program that writes KV, for every position the program may write.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from metrale_jax.engine.capacity import PoolCounts
from metrale_jax.engine.prefix_cache import Hit, PrefixCache, Snapshot
from metrale_jax.engine.sequences import EngineError, SequenceState

#: The prefix-cache namespace of a serve's sequences (`BlockManager.default_namespace`).
SERVE_NAMESPACE = "serve"


class SlotAllocator:
    """LIFO free list over slots 0..n-1: the first allocation gets slot 0."""

    def __init__(self, n: int):
        self._free = list(range(n - 1, -1, -1))
        self._live: set[int] = set()

    def alloc(self) -> int:
        if not self._free:
            raise EngineError("no free sequence slot (all slots are in use; raise --max-batch-size)")
        s = self._free.pop()
        self._live.add(s)
        return s

    def free(self, s: int) -> None:
        if s not in self._live:
            raise EngineError(f"slot {s} is not allocated")
        self._live.remove(s)
        self._free.append(s)

    @property
    def live(self) -> int:
        return len(self._live)


class BlockAllocator:
    """Free list over physical blocks 0..n-1 (the null block is outside this range)."""

    def __init__(self, n: int, what: str):
        self._free = list(range(n - 1, -1, -1))
        self._n = n
        self._what = what

    def alloc_many(self, count: int) -> list[int]:
        if count > len(self._free):
            raise EngineError(f"{self._what} exhausted: {count} block(s) needed, {len(self._free)} free")
        return [self._free.pop() for _ in range(count)]

    def free_many(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    @property
    def free_count(self) -> int:
        return len(self._free)


class BlockManager:
    """One engine's slots, blocks and prefix cache (module invariants). `slots`, `kv` and `draft`
    are the sequence-slot, trunk KV and drafter KV allocators; `prefix` the prefix cache (None
    without --enable-prefix-caching); `default_namespace` the namespace of sequences allocated
    without one (None: uncached)."""

    def __init__(self, counts: PoolCounts, max_seq_len: int, prefix_caching: bool):
        self.counts, self.max_seq_len, self.drafter = counts, max_seq_len, counts.drafter
        self.slots = SlotAllocator(counts.real_slots)
        self.kv = BlockAllocator(counts.kv_blocks - 1, "KV blocks")
        self.draft = BlockAllocator(max(counts.draft_kv_blocks - 1, 0), "drafter KV blocks")
        self.prefix = (
            PrefixCache(counts.block_size, counts.draft_block_size, counts.snapshot_slots, self.drafter)
            if prefix_caching
            else None
        )
        self.default_namespace: str | None = SERVE_NAMESPACE if self.prefix is not None else None
        self._next_id = 0

    # ------------------------------------------------------------ sequences

    def alloc(self, namespace: str | None = None) -> SequenceState:
        """A fresh sequence on the lowest free slot; `namespace`: its prefix-cache namespace
        (needs prefix caching; None: `default_namespace`)."""
        if namespace is not None and self.prefix is None:
            raise EngineError("a prefix-cache namespace needs --enable-prefix-caching")
        namespace = self.default_namespace if namespace is None else namespace
        seq = SequenceState(seq_id=self._next_id, slot=self.slots.alloc(), namespace=namespace)
        self._next_id += 1
        return seq

    def free(self, seq: SequenceState) -> None:
        """Give back `seq`'s slot and blocks (cached blocks lose a reference)."""
        if seq.freed:
            raise EngineError(f"sequence {seq.seq_id} was already freed")
        self.slots.free(seq.slot)
        self._release(seq.blocks, seq.draft_blocks)
        seq.blocks, seq.draft_blocks, seq.freed = [], [], True

    def _release(self, blocks: list[int], draft_blocks: list[int]) -> None:
        """Give back a sequence's blocks: cached ones lose a reference, the rest are freed."""
        if self.prefix is not None:
            blocks, draft_blocks = self.prefix.kv.release(blocks), self.prefix.draft.release(draft_blocks)
        self.kv.free_many(blocks)
        self.draft.free_many(draft_blocks)

    @staticmethod
    def rewind(seq: SequenceState, rejected: int) -> None:
        """Drop `seq`'s last `rejected` positions (their KV is left in place and overwritten
        before it is ever read); refused below the positions held in shared prefix-cache blocks."""
        if not 0 <= rejected <= seq.seq_len:
            raise EngineError(f"cannot rewind {rejected} rows of sequence {seq.seq_id}")
        if seq.seq_len - rejected < seq.shared_len:
            raise EngineError(
                f"cannot rewind sequence {seq.seq_id} below {seq.shared_len}: those positions are in shared "
                "prefix-cache blocks"
            )
        seq.seq_len -= rejected
        del seq.tokens[len(seq.tokens) - rejected :]

    # ------------------------------------------------------------ reservations

    def reserve(self, seqs: Sequence[SequenceState], upto: Sequence[int], held: tuple[int, int] | None = None) -> None:
        """Give each sequence KV blocks (and drafter blocks) for positions < upto[i]; all or none.
        `held`: instead, exactly this many (KV, drafter) blocks each (a swap-in restores the count
        it saved). Refuses (EngineError, nothing changed) a sequence given twice, freed, not
        allocated by this manager, past --max-seq-len, or more blocks than are free."""
        bs, dbs = self.counts.block_size, self.counts.draft_block_size
        ids = [s.seq_id for s in seqs]
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice or len({s.slot for s in seqs}) < len(seqs):
            raise EngineError(f"sequence(s) {twice or ids} given twice (or sharing a slot) in one batch")
        for s, u in zip(seqs, upto):
            if s.freed:
                raise EngineError(f"sequence {s.seq_id} was freed")
            if not (0 <= s.seq_id < self._next_id and 0 <= s.slot < self.counts.real_slots):
                raise EngineError(f"sequence {s.seq_id} (slot {s.slot}) was not allocated by this engine")
            if u > self.max_seq_len:
                raise EngineError(f"sequence {s.seq_id} would reach {u} tokens, over --max-seq-len {self.max_seq_len}")
        if held is None:
            need = [max(0, math.ceil(u / bs) - len(s.blocks)) for s, u in zip(seqs, upto)]
            dneed = [
                max(0, math.ceil(u / dbs) - len(s.draft_blocks)) if self.drafter else 0 for s, u in zip(seqs, upto)
            ]
        else:
            most = (math.ceil(self.max_seq_len / bs), math.ceil(self.max_seq_len / dbs))
            if held[0] > most[0] or held[1] > (most[1] if self.drafter else 0):
                raise EngineError(f"{held} (KV, drafter) blocks per sequence exceed this engine's {most}")
            need = [max(0, held[0] - len(s.blocks)) for s in seqs]
            dneed = [max(0, held[1] - len(s.draft_blocks)) for s in seqs]
        self.make_room(sum(need), sum(dneed))
        if sum(need) > self.kv.free_count:
            raise EngineError(f"KV blocks exhausted: {sum(need)} needed, {self.kv.free_count} free")
        if sum(dneed) > self.draft.free_count:
            raise EngineError(f"drafter KV blocks exhausted: {sum(dneed)} needed, {self.draft.free_count} free")
        for s, n, dn in zip(seqs, need, dneed):
            s.blocks += self.kv.alloc_many(n)
            s.draft_blocks += self.draft.alloc_many(dn)

    def make_room(self, need: int, dneed: int) -> None:
        """Evict least recently used unreferenced cached blocks so that `need` KV and `dneed`
        drafter blocks are free, only when that suffices for both (else nothing changes)."""
        if self.prefix is None:
            return
        short = max(0, need - self.kv.free_count), max(0, dneed - self.draft.free_count)
        if short[0] > self.prefix.kv.evictable or short[1] > self.prefix.draft.evictable:
            return
        self.kv.free_many(self.prefix.kv.evict(short[0]))
        self.draft.free_many(self.prefix.draft.evict(short[1]))

    # ------------------------------------------------------------ prefix cache

    def caches(self, seq: SequenceState) -> bool:
        """`seq`'s prefills restore and cache (prefix caching on, and it has a namespace)."""
        return self.prefix is not None and seq.namespace is not None

    def lookup(self, seq: SequenceState, tokens: list[int]) -> tuple[Hit | None, int]:
        """For a fresh sequence's prefill of `tokens`: the longest cached prefix it restores (None:
        none) and the branch position, where the prompt leaves the cached KV blocks (0 when
        `seq` is uncached)."""
        if self.prefix is None or seq.namespace is None:
            return None, 0
        hit = self.prefix.longest(seq.namespace, tokens)
        return hit, self.prefix.kv_depth(seq.namespace, tokens[:-1]) * self.counts.block_size

    def share(self, seq: SequenceState, hit: Hit, tokens: list[int]) -> None:
        """Give fresh `seq` the blocks of `hit` (a prefix of `tokens`, shared read-only) and reserve
        the rest for the whole prompt; all or nothing (a refusal gives the shared blocks back)."""
        assert self.prefix is not None
        self.prefix.kv.acquire(hit.blocks)
        self.prefix.draft.acquire(hit.draft_blocks)
        seq.blocks, seq.draft_blocks = list(hit.blocks), list(hit.draft_blocks)
        try:
            self.reserve([seq], [len(tokens) + 1])
        except EngineError:
            self._release(seq.blocks, seq.draft_blocks)
            seq.blocks, seq.draft_blocks = [], []
            raise

    def cache(self, seq: SequenceState) -> Snapshot | None:
        """After a prefill program of cached `seq`: cache its full KV blocks and the drafter blocks
        whose pairs are all committed; at a block-aligned length, the snapshot slot its state is
        to be copied into (None: none, no slots, or that prefix has one already)."""
        assert self.prefix is not None and seq.namespace is not None
        ns, n = seq.namespace, seq.seq_len
        keys = self.prefix.kv_keys(ns, seq.tokens)
        for key, block in zip(keys, seq.blocks):
            self.prefix.kv.register(key, block)
        if self.drafter:
            for key, block in zip(self.prefix.draft_keys(ns, seq.tokens), seq.draft_blocks):
                self.prefix.draft.register(key, block)
        seq.shared_len = max(seq.shared_len, len(keys) * self.counts.block_size)
        if n % self.counts.block_size or not keys:
            return None
        return self.prefix.snapshots.claim(keys[-1], n)
