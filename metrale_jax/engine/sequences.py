"""Host bookkeeping: sequence state, the slot free list and the block allocators.

Owns: `SequenceState` (what the host knows of a sequence), `SlotAllocator` (LIFO, so freeing in
reverse allocation order reproduces the same layout) and `BlockAllocator`.
Invariants: a slot or block is owned by at most one live sequence; allocation is all-or-nothing
(a request that cannot be met changes nothing); freeing twice is an error.
"""

from __future__ import annotations

import dataclasses

from metrale_jax.errors import MetraleError


class EngineError(MetraleError, RuntimeError):
    """A request the engine refuses (capacity, exhaustion, misuse); its state is unchanged."""


@dataclasses.dataclass
class SequenceState:
    """slot: GDN state slot; blocks / draft_blocks: physical KV blocks in logical order; seq_len:
    tokens in the cache; tokens: prompt + generated (committed) tokens; drafter_len: positions
    of drafter context the host considers live; last_num_drafted: drafts of the last propose;
    namespace: its prefix-cache namespace (None: uncached); restored_at: the position its first
    prefill restored from a snapshot (0: computed); shared_len: positions below it lie in
    prefix-cache blocks (read-only, never rewound into)."""

    seq_id: int
    slot: int
    blocks: list[int] = dataclasses.field(default_factory=list)
    draft_blocks: list[int] = dataclasses.field(default_factory=list)
    seq_len: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)
    drafter_len: int = 0
    last_num_drafted: int = 0
    freed: bool = False
    namespace: str | None = None
    restored_at: int = 0
    shared_len: int = 0


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
        out = [self._free.pop() for _ in range(count)]
        return out

    def free_many(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    @property
    def free_count(self) -> int:
        return len(self._free)
