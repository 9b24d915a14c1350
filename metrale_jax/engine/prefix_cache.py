"""The prefix cache's host bookkeeping: hash chains, block reference counts, and the LRUs of
unreferenced cached blocks and of snapshot slots.

Owns: `chain_keys` (the digest of every block-aligned prefix of a token list, per namespace),
`BlockCache` (the cached blocks of one paged KV pool: key <-> block, reference counts, the LRU of
the unreferenced ones), `SnapshotTable` (which prefix each recurrent-state snapshot slot holds,
in LRU order) and `PrefixCache` (the three of them for one engine, with `longest`, the restore
lookup). Pure host state, no JAX and no NumPy: the block manager (`engine.blocks`) drives it, the
device copies are the engine's (`transitions.take_snapshot`, `transitions.restore_snapshot`).

Invariants:
- A key digests (namespace, a tag naming the pool, the tokens of the prefix the entry depends
  on): two namespaces, or the trunk's and the drafter's pools, never share an entry.
- A cached block holds final rows only: it is registered once every row of it is committed and
  is read-only from then on (no sequence writes a position below its own length).
- A referenced block is never evicted (`evict_block` refuses with `EngineError`); an unreferenced
  cached block waits in the LRU and goes back to its allocator only through `evict`.
- A snapshot slot holds the state after exactly `position` committed prefill tokens; claiming a
  slot when all are taken evicts the least recently used snapshot (restores copy out at once, so
  no snapshot is ever in use).
"""

from __future__ import annotations

import array
import collections
import dataclasses
import hashlib
from collections.abc import Sequence

from metrale_jax.engine.sequences import EngineError

Key = bytes


def chain_keys(namespace: str, tag: str, tokens: Sequence[int], block: int, extra: int = 0) -> list[Key]:
    """keys[j] digests (namespace, tag, tokens[: block * (j + 1) + extra]) for every j whose prefix
    fits in `tokens`. One pass: a running hash per block, copied for the `extra` tokens."""
    h = hashlib.blake2b(f"{namespace}\x00{tag}\x00".encode(), digest_size=16)
    arr = array.array("q", tokens)  # int64: the same bytes as a NumPy int64 array
    out = []
    for j in range((len(arr) - extra) // block if len(arr) >= extra else 0):
        h.update(arr[j * block : (j + 1) * block].tobytes())
        k = h.copy()
        k.update(b"\x01" + arr[(j + 1) * block : (j + 1) * block + extra].tobytes())
        out.append(k.digest())
    return out


class BlockCache:
    """The cached blocks of one paged KV pool (module invariants)."""

    def __init__(self, what: str):
        self.what = what
        self._block: dict[Key, int] = {}
        self._key: dict[int, Key] = {}
        self._refs: dict[int, int] = {}
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.evictions = 0

    def lookup(self, key: Key) -> int | None:
        return self._block.get(key)

    def cached(self, block: int) -> bool:
        return block in self._key

    def refs(self, block: int) -> int:
        return self._refs.get(block, 0)

    def register(self, key: Key, block: int) -> bool:
        """Cache `block` (held by one live sequence) under `key`; False (nothing changed) when the
        key or the block is cached already."""
        if key in self._block or block in self._key:
            return False
        self._block[key], self._key[block], self._refs[block] = block, key, 1
        return True

    def acquire(self, blocks: Sequence[int]) -> None:
        """One more reference to each cached block (out of the LRU)."""
        for b in blocks:
            self._refs[b] += 1
            self._lru.pop(b, None)

    def release(self, blocks: Sequence[int]) -> list[int]:
        """Drop one reference to each of `blocks`; cached ones left unreferenced join the LRU.
        Returns the blocks that are not cached (the caller frees them to its allocator)."""
        own = []
        for b in blocks:
            if b not in self._key:
                own.append(b)
                continue
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._lru[b] = None
        return own

    @property
    def evictable(self) -> int:
        return len(self._lru)

    def evict(self, n: int) -> list[int]:
        """Uncache the `n` least recently released unreferenced blocks; returns them."""
        if n > len(self._lru):
            raise EngineError(f"{self.what}: {n} block(s) to evict, {len(self._lru)} unreferenced")
        out = [self._lru.popitem(last=False)[0] for _ in range(n)]
        for b in out:
            del self._block[self._key.pop(b)], self._refs[b]
        self.evictions += n
        return out

    def evict_block(self, block: int) -> None:
        """Uncache `block`; refused (EngineError, nothing changed) while a sequence references it."""
        if block not in self._key:
            raise EngineError(f"{self.what} block {block} is not cached")
        if self._refs[block]:
            raise EngineError(f"{self.what} block {block} is referenced by {self._refs[block]} sequence(s)")
        del self._lru[block], self._block[self._key.pop(block)], self._refs[block]


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Snapshot slot `slot` holds the state after `position` tokens."""

    slot: int
    position: int


class SnapshotTable:
    """Which prefix each of `n` snapshot slots holds, least recently used first."""

    def __init__(self, n: int):
        self.n = n
        self._by_key: collections.OrderedDict[Key, Snapshot] = collections.OrderedDict()
        self.evictions = 0

    def peek(self, key: Key) -> Snapshot | None:
        return self._by_key.get(key)

    def touch(self, key: Key) -> None:
        self._by_key.move_to_end(key)

    def claim(self, key: Key, position: int) -> Snapshot | None:
        """A slot for the snapshot of `key` (the least recently used one when all are taken), or
        None: no slots, or `key` is held already (then it becomes the most recently used)."""
        if key in self._by_key:
            self.touch(key)
            return None
        if self.n == 0:
            return None
        if len(self._by_key) < self.n:
            slot = len(self._by_key)
        else:
            slot = self._by_key.popitem(last=False)[1].slot
            self.evictions += 1
        snap = self._by_key[key] = Snapshot(slot, position)
        return snap

    def __len__(self) -> int:
        return len(self._by_key)


@dataclasses.dataclass(frozen=True)
class Hit:
    """A restore: the snapshot, the trunk KV blocks of positions < position and the drafter's
    full blocks below drafter position position - 1 (shared read-only)."""

    snapshot: Snapshot
    blocks: list[int]
    draft_blocks: list[int]


TRUNK, DRAFTER = "kv", "draft"


class PrefixCache:
    """The prefix cache of one engine: trunk and drafter block caches and the snapshot table.
    `drafter`: the engine runs an MTP drafter (its KV and context are cached too)."""

    def __init__(self, block_size: int, draft_block_size: int, snapshot_slots: int, drafter: bool):
        self.block_size, self.draft_block_size, self.drafter = block_size, draft_block_size, drafter
        self.kv = BlockCache("KV")
        self.draft = BlockCache("drafter KV")
        self.snapshots = SnapshotTable(snapshot_slots)
        self.hits = 0  # restores found by `longest`

    def kv_keys(self, namespace: str, tokens: Sequence[int]) -> list[Key]:
        return chain_keys(namespace, TRUNK, tokens, self.block_size)

    def draft_keys(self, namespace: str, tokens: Sequence[int]) -> list[Key]:
        """Drafter block j holds the pairs (hidden of q, token q + 1) of positions q < 16 (j + 1):
        its key covers one token past the block."""
        return chain_keys(namespace, DRAFTER, tokens, self.draft_block_size, extra=1)

    def kv_depth(self, namespace: str, tokens: Sequence[int]) -> int:
        """How many leading full KV blocks of `tokens` are cached (in this namespace)."""
        keys = self.kv_keys(namespace, tokens)
        return next((j for j, k in enumerate(keys) if self.kv.lookup(k) is None), len(keys))

    def longest(self, namespace: str, tokens: Sequence[int]) -> Hit | None:
        """The longest restorable prefix of `tokens` shorter than all of it (a prefill computes at
        least one token): a snapshot at a block-aligned position p whose KV blocks (and drafter
        blocks) are all still cached. Touches what it returns in the LRUs; counts the hit."""
        keys = self.kv_keys(namespace, tokens[: len(tokens) - 1])
        for j in range(len(keys) - 1, -1, -1):
            snap = self.snapshots.peek(keys[j])
            if snap is None:
                continue
            blocks = [self.kv.lookup(k) for k in keys[: j + 1]]
            dkeys = self.draft_keys(namespace, tokens[: snap.position]) if self.drafter else []
            draft = [self.draft.lookup(k) for k in dkeys]
            if any(b is None for b in blocks + draft):
                continue
            self.snapshots.touch(keys[j])
            self.hits += 1
            return Hit(snap, [int(b) for b in blocks if b is not None], [int(b) for b in draft if b is not None])
        return None
