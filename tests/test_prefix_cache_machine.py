"""The prefix cache under pressure, as a state machine (hypothesis `RuleBasedStateMachine`).

Random prefills over a few shared stems in two namespaces (restores, partial hits), decode and
MTP verify steps (reserve for the drafts, then rewind the rejected), swap out and in (free, then a
fresh sequence restoring the held counts), explicit eviction pressure, and frees, driven through
`engine.blocks.BlockManager` as the engine drives it (pure host code: no engine, no JAX). After
every rule the manager is checked against a plain model:
- conservation: every trunk and drafter block is free, owned by exactly one live sequence, or
  cached, and never two of these;
- reference counts: a cached block's count is the number of live sequences mapping it, and the
  LRU holds exactly the cached blocks no sequence maps;
- LRU order: whatever eviction uncaches is the oldest-released part of the model's LRU;
- namespace isolation: a share hands a sequence only blocks cached from its own namespace.
`test_a_planted_lru_refcount_or_namespace_bug_is_found_quickly` plants each bug class and requires the
machine to find it within its deadline.
"""

from __future__ import annotations

import time

import pytest
from block_managers import speculative_manager
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from metrale_jax.engine import prefix_cache
from metrale_jax.engine.blocks import BlockManager
from metrale_jax.engine.sequences import EngineError

MAX_SEQ_LEN, BLOCK, SLOTS, DRAFTS = 64, 16, 3, 3
STEMS = [[100 + 7 * i + j for j in range(48)] for i in range(2)]


def manager() -> BlockManager:
    return speculative_manager(SLOTS, MAX_SEQ_LEN, BLOCK, True, DRAFTS)


class Pool:
    """The plain model of one paged pool's cache: which namespace cached each block and the LRU
    order of the unreferenced ones."""

    def __init__(self, name: str, total: int):
        self.name, self.total = name, total
        self.namespace: dict[int, str] = {}
        self.lru: list[int] = []


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.m = manager()
        self.live: list = []
        self.pools = {
            "kv": (Pool("kv", self.m.counts.kv_blocks - 1), self.m.kv, self.m.prefix.kv),
            "draft": (Pool("draft", self.m.counts.draft_kv_blocks - 1), self.m.draft, self.m.prefix.draft),
        }

    # ---------------------------------------------------------------- model upkeep

    def _held(self, which: str) -> list[int]:
        return [b for s in self.live for b in (s.blocks if which == "kv" else s.draft_blocks)]

    def _cached(self, which: str) -> set[int]:
        pool, _, cache = self.pools[which]
        return {b for b in range(pool.total) if cache.cached(b)}

    def _sync(self, namespace: str | None = None) -> None:
        """After a rule: what eviction uncached must be the oldest of the model's LRU; newly cached
        blocks take `namespace`; blocks a sequence maps again (acquired) leave the LRU.
        NOTE: only cached blocks are pruned as held before the order check: an evicted block may
        already be some sequence's own block again (the reservation that evicted it took it)."""
        for which, (pool, _, _) in self.pools.items():
            cached, held = self._cached(which), set(self._held(which))
            pool.lru = [b for b in pool.lru if not (b in held and b in cached)]
            gone = [b for b in pool.namespace if b not in cached]
            assert set(gone) == set(pool.lru[: len(gone)]), f"{which}: evicted {gone}, LRU order {pool.lru}"
            for b in gone:
                del pool.namespace[b]
                pool.lru.remove(b)
            for b in sorted(cached - set(pool.namespace)):
                assert namespace is not None, f"{which} block {b} cached outside a prefill"
                pool.namespace[b] = namespace

    def _released(self, blocks: dict[str, list[int]]) -> None:
        """The model's LRU after a sequence let go of `blocks` (in the order it held them)."""
        for which, (pool, _, _) in self.pools.items():
            held = set(self._held(which))
            for b in blocks[which]:
                if b in pool.namespace and b not in held:
                    pool.lru = [x for x in pool.lru if x != b] + [b]

    def _free(self, seq) -> None:
        blocks = {"kv": list(seq.blocks), "draft": list(seq.draft_blocks)}
        self.live.remove(seq)
        self.m.free(seq)
        self._released(blocks)

    # ---------------------------------------------------------------- rules

    @precondition(lambda self: self.m.slots.live < SLOTS)
    @rule(stem=st.integers(0, 1), cut=st.integers(1, 3), tail=st.integers(0, 9), ns=st.sampled_from(["a", "b"]))
    def prefill(self, stem, cut, tail, ns):
        tokens = STEMS[stem][: BLOCK * cut] + [9000 + stem * 10 + tail] * (tail + 1)
        seq = self.m.alloc(ns)
        self.live.append(seq)
        hit, _ = self.m.lookup(seq, tokens)
        try:
            if hit is not None:
                for which, blocks in (("kv", hit.blocks), ("draft", hit.draft_blocks)):
                    spaces = {self.pools[which][0].namespace.get(b) for b in blocks}
                    assert spaces <= {ns}, f"namespace {ns} shares {which} blocks cached by {spaces}"
                self.m.share(seq, hit, tokens)
            else:
                self.m.reserve([seq], [len(tokens) + 1])
            self._sync()  # what the reservation evicted, before a block is cached again
        except EngineError:  # a refused share gives the hit's blocks back (to the LRU's end)
            self._free(seq)
            if hit is not None:
                self._released({"kv": hit.blocks, "draft": hit.draft_blocks})
            self._sync()
            return
        for end in (len(tokens) // BLOCK * BLOCK, len(tokens)):
            seq.seq_len, seq.tokens, seq.drafter_len = end, tokens[:end], end
            self.m.cache(seq)
        self._sync(ns)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, SLOTS - 1), accepted=st.integers(0, DRAFTS))
    def verify(self, i, accepted):
        """An MTP step: room for the drafts and the next propose, then the rejected rows rewound."""
        seq = self.live[i % len(self.live)]
        try:
            self.m.reserve([seq], [seq.seq_len + DRAFTS + 1 + DRAFTS])
        except EngineError:
            self._sync()
            return
        seq.tokens += [5] * (DRAFTS + 1)
        seq.seq_len += DRAFTS + 1
        self.m.rewind(seq, DRAFTS - accepted)
        seq.drafter_len = seq.seq_len
        self._sync()

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, SLOTS - 1))
    def free(self, i):
        self._free(self.live[i % len(self.live)])
        self._sync()

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, SLOTS - 1))
    def swap(self, i):
        """Swap out (free) and in (a fresh sequence restoring the held counts)."""
        seq = self.live[i % len(self.live)]
        held = (len(seq.blocks), len(seq.draft_blocks))
        self._free(seq)
        new = self.m.alloc(seq.namespace)
        self.live.append(new)
        try:
            self.m.reserve([new], [seq.seq_len], held=held)
        except EngineError:
            self._free(new)
        else:
            new.seq_len, new.tokens, new.drafter_len = seq.seq_len, list(seq.tokens), seq.drafter_len
        self._sync()

    @rule(n=st.integers(1, 4))
    def evict(self, n):
        """Pressure: ask for n more free blocks of each pool than there are."""
        self.m.make_room(self.m.kv.free_count + n, self.m.draft.free_count + n)
        self._sync()

    # ---------------------------------------------------------------- the checks

    @invariant()
    def blocks_are_conserved_and_counted(self):
        for which, (pool, alloc, cache) in self.pools.items():
            held = self._held(which)
            cached = self._cached(which)
            own = [b for b in held if b not in cached]
            assert len(own) == len(set(own)), f"{which}: an own block held twice"
            assert alloc.free_count + len(own) + len(cached) == pool.total, f"{which}: a block leaked or doubled"
            for b in cached:
                assert cache.refs(b) == held.count(b), f"{which} block {b}: {cache.refs(b)} refs, {held.count(b)} maps"
            assert cache.evictable == sum(1 for b in cached if b not in held), f"{which}: LRU != unreferenced"
            assert set(pool.lru) == {b for b in cached if b not in held}

    def teardown(self):
        for seq in list(self.live):
            self._free(seq)
        self._sync()
        self.blocks_are_conserved_and_counted()


FAST = settings(
    phases=[Phase.generate],
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)


def test_the_prefix_cache_matches_its_model():
    run_state_machine_as_test(PrefixCacheMachine, settings=FAST)


def _acquire_keeps_lru(self, blocks):
    for b in blocks:
        self._refs[b] += 1


_release = prefix_cache.BlockCache.release


def _release_leaves_lru(self, blocks):
    own = _release(self, blocks)
    for b in blocks:  # held until now, so in the LRU only if this release put it there
        self._lru.pop(b, None)
    return own


_chain_keys = prefix_cache.chain_keys


def _keys_without_namespace(namespace, tag, tokens, block, extra=0):
    return _chain_keys("", tag, tokens, block, extra)


@pytest.mark.parametrize(
    "owner, name, bug",
    [
        (prefix_cache.BlockCache, "acquire", _acquire_keeps_lru),
        (prefix_cache.BlockCache, "release", _release_leaves_lru),
        (prefix_cache, "chain_keys", _keys_without_namespace),
    ],
    ids=["lru-keeps-a-referenced-block", "release-skips-the-lru", "keys-ignore-the-namespace"],
)
def test_a_planted_lru_refcount_or_namespace_bug_is_found_quickly(monkeypatch, owner, name, bug):
    monkeypatch.setattr(owner, name, bug)
    t0 = time.perf_counter()
    hunt = settings(FAST, max_examples=400, phases=[Phase.generate], database=None)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(PrefixCacheMachine, settings=hunt)
    assert time.perf_counter() - t0 < 30
