"""Prefix caching with recurrent-state snapshots: restored prefill against computed, generation
with the cache against without it, and the named regressions of the public failure classes
(snapshot reuse after eviction, rejected draft rows, a hit then an immediate propose, diverging
sequences over shared blocks, referenced-block eviction, snapshot exhaustion).

The exactness claim is bytewise: a restored prefill equals a prefill that computed the same
tokens with its programs split at the restore position (`_computed`), logits and every pool leaf
of the sequence. Against a prefill split elsewhere the bytes differ in the last ulp (XLA CPU dots
are not batch-invariant), so generation is compared token for token.
"""

import collections
import dataclasses
import itertools
import types

import numpy as np
import pytest
from conftest import settings
from conversations import conversations, random_tokens
from test_engine import _poison_except

from metrale_jax.diff import render_summary, run_diff
from metrale_jax.diff.prefill import cached_leg
from metrale_jax.diff.request import CACHED_TAIL, DiffRequest
from metrale_jax.diff.state import state_parts
from metrale_jax.diff.variants import REFERENCE, Variant
from metrale_jax.engine.engine import Engine
from metrale_jax.engine.prefix_cache import BlockCache, PrefixCache, Snapshot, SnapshotTable, chain_keys
from metrale_jax.engine.sequences import EngineError
from metrale_jax.engine.speculative import DraftSchedule, greedy_generate, speculative_generate

_ns = itertools.count()
ENGINES: dict[tuple, Engine] = {}


def _engine(tiny, block_size=16, cache=True, chunk=8192) -> Engine:
    """One engine per (block size, cache, prefill chunk), shared by the module's tests."""
    key = (block_size, cache, chunk)
    if key not in ENGINES:
        cfg, params = tiny
        flags = dict(max_batch_size=6, max_seq_len=256, speculative=True, num_drafts=3, block_size=block_size)
        ENGINES[key] = Engine(
            cfg,
            params,
            settings(**flags, enable_prefix_caching=cache, ssm_cache_slots=4, max_prefill_tokens=chunk),
        )
    return ENGINES[key]


def _ns_name() -> str:
    return f"test-{next(_ns)}"


def _prefilled(eng, ns, parts, chunk):
    """A sequence of namespace `ns` prefilled with each of `parts` in turn: (the last prefill's
    logits, the live sequence)."""
    s = eng.alloc_sequence(ns)
    logits = [eng.prefill(s, p, chunk) for p in parts]
    return logits[-1], s


def _record(eng, s):
    return state_parts(eng.cfg, eng.save_sequence_state(s))


def _assert_same_state(eng, a, b):
    for x, y in zip(_record(eng, a), _record(eng, b)):
        np.testing.assert_array_equal(x.data, y.data, err_msg=x.name)


def _prime(eng, prompt, chunk, ns):
    s = eng.alloc_sequence(ns)
    eng.prefill(s, prompt, chunk)
    eng.free_sequence(s)


def _computed(eng, tokens, at, chunk):
    """The uncached prefill of `tokens` split at `at` (a fresh namespace: nothing to restore)."""
    return _prefilled(eng, _ns_name(), [tokens[:at], tokens[at:]] if at else [tokens], chunk)


@pytest.mark.parametrize(
    "length, tail, chunk, block_size, forward",
    [
        (70, 21, 32, 16, "xla"),
        (100, 9, 64, 8, "xla"),
        (47, 30, 16, 16, "xla"),
        (33, 40, 8192, 8, "xla"),
        (70, 21, 32, 16, "pallas"),
        (100, 9, 64, 8, "pallas"),
    ],
)
def test_restored_prefill_equals_computed_bytewise(tiny, length, tail, chunk, block_size, forward):
    """Prime a prompt, then prefill it plus a tail in the same namespace: it restores at the
    prompt's last full block and its logits and every state leaf (GDN h and conv, KV, the
    drafter's stash and KV) equal the uncached prefill split there, byte for byte; against the
    unsplit prefill they agree to f32 rounding."""
    eng = _engine(tiny, block_size)
    eng.set_forward(forward)
    try:
        prompt, full = random_tokens(length, length), random_tokens(length, length) + random_tokens(tail, tail)
        ns = _ns_name()
        _prime(eng, prompt, chunk, ns)
        got, s = _prefilled(eng, ns, [full], chunk)
        at = length // block_size * block_size
        assert s.restored_at == at and s.seq_len == len(full)
        ref, r = _computed(eng, full, at, chunk)
        plain, q = _prefilled(eng, _ns_name(), [full], chunk)
        try:
            np.testing.assert_array_equal(got, ref)
            _assert_same_state(eng, s, r)
            np.testing.assert_allclose(got, plain, rtol=1e-4, atol=1e-4)
            assert q.restored_at == 0
            copies = {i.name: i.pool_copies for i in eng.programs.info.values() if "snapshot" in i.name}
            assert set(copies) == {"take_snapshot", "restore_snapshot"} and not any(copies.values())
        finally:
            for x in (q, r, s):
                eng.free_sequence(x)
    finally:
        eng.set_forward("xla")


@pytest.mark.parametrize("num_drafts", [1, 2, 3])
def test_speculative_with_prefix_cache_equals_greedy_without(tiny, num_drafts):
    """Multi-turn conversations (misses, partial hits on the shared system prompt, hits on each
    conversation's own history, two sequences live over shared blocks) generate with the cache on
    and MTP drafts exactly the tokens plain greedy generates without the cache."""
    on, off = _engine(tiny, chunk=32), _engine(tiny, cache=False, chunk=32)
    on.blocks.default_namespace = _ns_name()
    hits = on.blocks.prefix.hits if on.blocks.prefix else 0
    cached = conversations(
        on, 3, lambda e, ps: speculative_generate(e, ps, 10, DraftSchedule(num_drafts), fused=num_drafts != 2).tokens
    )
    plain = conversations(off, 3, lambda e, ps: greedy_generate(e, ps, 10))
    assert cached == plain
    assert on.blocks.prefix is not None and on.blocks.prefix.hits - hits >= 5


def test_snapshot_slot_reused_after_lru_eviction_holds_the_new_prefix(tiny):
    """Five primed prompts over four snapshot slots: the first's snapshots are evicted (a
    prefill of it computes), and a slot reused by a later prompt restores that prompt's state,
    never the evicted one's."""
    eng = _engine(tiny)
    ns = _ns_name()
    prompts = [random_tokens(200 + i, 20 + i) for i in range(5)]
    evictions = eng.blocks.prefix.snapshots.evictions if eng.blocks.prefix else 0
    for p in prompts:
        _prime(eng, p, 16, ns)
    assert eng.blocks.prefix is not None and eng.blocks.prefix.snapshots.evictions > evictions
    first, s0 = _prefilled(eng, ns, [prompts[0] + [1, 2]], 16)
    last, s4 = _prefilled(eng, ns, [prompts[4] + [3, 4]], 16)
    ref, r = _computed(eng, prompts[4] + [3, 4], 16, 16)
    try:
        assert s0.restored_at == 0 and s4.restored_at == 16
        np.testing.assert_array_equal(last, ref)
        _assert_same_state(eng, s4, r)
    finally:
        for x in (r, s4, s0):
            eng.free_sequence(x)


def test_snapshot_never_includes_rejected_draft_rows(tiny):
    """A sequence verifies drafts whose tail is rejected, then prefills the next user turn: the
    snapshot at that prefill's end holds its committed state only, so a new sequence restoring it
    continues exactly as the sequence itself does."""
    eng = _engine(tiny)
    ns = _ns_name()
    a = eng.alloc_sequence(ns)
    last = int(eng.prefill(a, random_tokens(5, 23)).argmax())
    eng.verify_batched([a], [last, 9, 9, 9], [4])
    eng.accept([a], [0])  # rows 1..3 rejected: their KV, GDN and drafter rows are junk
    eng.prefill(a, random_tokens(6, 48 - a.seq_len))  # the next turn ends block-aligned: a snapshot
    assert a.seq_len == 48
    tail = random_tokens(7, 11)
    b = eng.alloc_sequence(ns)
    got_b = eng.prefill(b, a.tokens + tail)
    got_a = eng.prefill(a, tail)
    try:
        assert b.restored_at == 48
        np.testing.assert_array_equal(got_a, got_b)
        _assert_same_state(eng, a, b)
    finally:
        for x in (b, a):
            eng.free_sequence(x)


def test_cache_hit_then_immediate_propose_drafts_as_computed(tiny):
    """Right after a restored prefill, the MTP drafter proposes exactly what it proposes after the
    computed one (the stash and the drafter's KV context restored): drafts, confidences, logits."""
    eng = _engine(tiny)
    ns, full = _ns_name(), random_tokens(8, 60)
    _prime(eng, full[:50], None, ns)
    got, s = _prefilled(eng, ns, [full], None)
    ref, r = _computed(eng, full, 48, None)
    try:
        assert s.restored_at == 48
        a = eng.propose_batched([s], [int(got.argmax())], 3)
        b = eng.propose_batched([r], [int(ref.argmax())], 3)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    finally:
        for x in (r, s):
            eng.free_sequence(x)


def _diverging(eng, poison: bool):
    """Prime a shared prefix, restore two sequences diverging after it (both live over the same
    blocks), optionally NaN-poison everything they do not own, then decode and propose."""
    ns, shared = _ns_name(), random_tokens(9, 40)
    _prime(eng, shared, None, ns)
    seqs = [eng.alloc_sequence(ns) for _ in range(2)]
    try:
        outs = [eng.prefill(s, shared + random_tokens(20 + i, 5 + 6 * i)) for i, s in enumerate(seqs)]
        assert [s.restored_at for s in seqs] == [32, 32]
        assert seqs[0].blocks[:2] == seqs[1].blocks[:2]
        if poison:
            pool = _poison_except(eng.pool, eng, seqs)
            leaves = ("snap_h", "snap_conv", "snap_stash", "snap_draft_k", "snap_draft_v")
            eng.pool = pool.replace(**{k: getattr(pool, k) * np.nan for k in leaves})
        last = [int(o.argmax()) for o in outs]
        for _ in range(3):
            outs.append(eng.decode_batch(seqs, last))
            last = [int(x) for x in outs[-1].argmax(-1)]
        outs += list(eng.propose_batched(seqs, [1, 2], 3))
        outs += [x.data for s in seqs for x in _record(eng, s)]
        return outs
    finally:
        for s in reversed(seqs):
            eng.free_sequence(s)


def test_shared_prefix_then_diverging_sequences_are_isolated(tiny):
    """Two sequences restored from one prefix then diverging: NaN in every slot, block, verify
    row, stash row and snapshot they do not own changes none of their logits, drafts or state."""
    eng = _engine(tiny)
    for a, b in zip(_diverging(eng, False), _diverging(eng, True)):
        np.testing.assert_array_equal(a, b)


def test_evicting_a_referenced_block_is_refused_and_exhaustion_evicts_the_lru(tiny):
    """A cached block a live sequence maps cannot be evicted; once unreferenced it waits in the
    LRU, and an allocation the free list cannot meet evicts from there instead of failing."""
    eng = _engine(tiny)
    assert eng.blocks.prefix is not None
    ns = _ns_name()
    _prime(eng, random_tokens(11, 40), None, ns)
    s = eng.alloc_sequence(ns)
    eng.prefill(s, random_tokens(11, 40) + [5])
    shared = s.blocks[0]
    assert eng.blocks.prefix.kv.refs(shared) == 1
    with pytest.raises(EngineError, match="referenced"):
        eng.blocks.prefix.kv.evict_block(shared)
    with pytest.raises(EngineError, match="shared"):
        eng.blocks.rewind(s, 10)
    eng.free_sequence(s)
    assert eng.blocks.prefix.kv.refs(shared) == 0 and eng.blocks.prefix.kv.evictable > 0
    free, lru = eng.blocks.kv.free_count, eng.blocks.prefix.kv.evictable
    eng.blocks.make_room(free + lru + 1, 0)  # more than eviction could give: nothing changes
    assert (eng.blocks.kv.free_count, eng.blocks.prefix.kv.evictable) == (free, lru)
    eng.blocks.make_room(free + 1, 0)  # what the allocator asks for one block past the free list
    assert (eng.blocks.kv.free_count, eng.blocks.prefix.kv.evictable) == (free + 1, lru - 1)


def test_snapshot_exhaustion_falls_back_to_computing():
    """No snapshot slot (or every snapshot evicted) means no restore: the lookup misses and the
    prefill computes; a table of n slots never holds more than n snapshots."""
    table = SnapshotTable(0)
    assert table.claim(b"k", 16) is None and len(table) == 0
    cache = PrefixCache(16, 16, 0, drafter=False)
    toks = list(range(40))
    for key, block in zip(cache.kv_keys("n", toks), range(2)):
        cache.kv.register(key, block)
    assert cache.longest("n", toks) is None
    table = SnapshotTable(2)
    slots = [table.claim(bytes([i]), 16 * i) for i in range(3)]
    assert [s.slot for s in slots if s] == [0, 1, 0] and len(table) == 2 and table.peek(bytes([0])) is None


def test_block_cache_references_and_namespaces():
    """Keys are namespaced and tag the pool; references count live holders; the LRU returns the
    least recently released block first."""
    toks = list(range(50))
    assert chain_keys("a", "kv", toks, 16) != chain_keys("b", "kv", toks, 16)
    assert chain_keys("a", "kv", toks, 16)[:2] == chain_keys("a", "kv", toks[:33], 16)
    assert len(chain_keys("a", "draft", toks, 16, extra=1)) == 3 and len(chain_keys("a", "d", toks[:48], 16, 1)) == 2
    c = BlockCache("KV")
    assert c.register(b"x", 3) and c.register(b"y", 4) and not c.register(b"x", 5)
    c.acquire([3])
    assert c.release([3, 4, 7]) == [7] and c.refs(3) == 1 and c.evictable == 1
    assert c.release([3]) == [] and c.evict(1) == [4] and c.evict(1) == [3] and c.lookup(b"x") is None


# ---------------------------------------------------------------- diff --prefill's cached leg


def test_diff_prefill_cached_leg_restores_and_passes(tiny):
    """`diff --prefill` at L >= 256 primes the prompt, then restores it under the tail on every
    path and forward; restored == computed byte for byte, and each entry names its path."""
    cfg, params = tiny
    eng = Engine(cfg, params, settings(max_batch_size=2, max_seq_len=320, enable_prefix_caching=True))
    report = run_diff(eng, DiffRequest(steps=2, prefill=(256,), prefill_chunk=(64,)), [Variant("xla-repeat", "xla")])
    assert report["verdict"] == "PASS", report["reasons"]
    assert [(e["path"], e["taken"], e["tokens"]) for e in report["cached"]] == [
        (p, "restored at 256", 256 + CACHED_TAIL) for p in ("single", "chunk 64") * 2
    ]
    assert all(c["prefill_equal"] for e in report["cached"] for c in e["comparisons"])
    assert "restored at 256" in render_summary(report) and eng.blocks.slots.live == 0


def test_diff_cached_leg_fails_on_a_wrong_snapshot_and_on_no_restore(tiny, monkeypatch):
    """Planted bugs: a restore from another prefix's snapshot slot FAILs naming a differing state
    leaf; a leg whose prime left no snapshot FAILs for not restoring."""
    eng = _engine(tiny)
    assert eng.blocks.prefix is not None
    prompt, tail = random_tokens(30, 64), random_tokens(31, 37)
    ref = Variant(REFERENCE, REFERENCE)
    _prime(eng, random_tokens(32, 64), None, _ns_name())  # another prefix in another snapshot slot
    right = eng.blocks.prefix.longest

    def wrong(namespace, tokens):
        hit = right(namespace, tokens)
        other = (hit.snapshot.slot + 1) % eng.blocks.prefix.snapshots.n if hit else 0
        return dataclasses.replace(hit, snapshot=Snapshot(other, hit.snapshot.position)) if hit else None

    monkeypatch.setattr(eng.blocks.prefix, "longest", wrong)
    entry, reason = cached_leg(eng, ref, "single", None, prompt, tail)
    assert entry["restored_at"] == 64 and reason and "differs" in reason
    assert entry["comparisons"][0]["state_diff"] is not None
    monkeypatch.setattr(eng.blocks.prefix, "longest", right)
    monkeypatch.setattr(eng.blocks.prefix.snapshots, "claim", lambda key, position: None)
    entry, reason = cached_leg(eng, ref, "single", None, random_tokens(33, 64), tail)
    assert entry["taken"] == "computed" and reason and "did not restore" in reason


def test_a_refused_restore_gives_its_shared_blocks_back(tiny, monkeypatch):
    """A restore whose tail cannot be reserved is refused with nothing changed: the shared blocks'
    references are back, the sequence is still fresh, and a later prefill restores normally."""
    eng = _engine(tiny)
    assert eng.blocks.prefix is not None
    ns, prompt = _ns_name(), random_tokens(40, 40)
    _prime(eng, prompt, None, ns)
    s = eng.alloc_sequence(ns)
    refs = [eng.blocks.prefix.kv.refs(b) for b in range(eng.counts.kv_blocks - 1)]
    free = eng.blocks.kv.free_count

    def refuse(*args, **kwargs):
        raise EngineError("KV blocks exhausted")

    monkeypatch.setattr(eng.blocks, "reserve", refuse)
    with pytest.raises(EngineError, match="exhausted"):
        eng.prefill(s, prompt + [1])
    assert (s.blocks, s.draft_blocks, s.seq_len, s.tokens) == ([], [], 0, [])
    assert [
        eng.blocks.prefix.kv.refs(b) for b in range(eng.counts.kv_blocks - 1)
    ] == refs and eng.blocks.kv.free_count == free
    monkeypatch.undo()
    eng.prefill(s, prompt + [1])
    assert s.restored_at == 32
    eng.free_sequence(s)


def _check_accounting(eng, live):
    """Every KV and drafter block is exactly one of: free, cached and unreferenced (the LRU), or
    held by live sequences (a cached one with as many references as holders, an own one by one)."""
    assert eng.blocks.prefix is not None
    for alloc, cache, held in (
        (eng.blocks.kv, eng.blocks.prefix.kv, [s.blocks for s in live]),
        (eng.blocks.draft, eng.blocks.prefix.draft, [s.draft_blocks for s in live]),
    ):
        free = alloc._free
        holders = collections.Counter(b for blocks in held for b in blocks)
        assert len(set(free)) == len(free) and not set(free) & set(holders)
        for b, n in holders.items():
            assert cache.refs(b) == n if cache.cached(b) else n == 1, b
        lru = [b for b in range(alloc._n) if cache.cached(b) and not cache.refs(b)]
        assert len(lru) == cache.evictable and not set(lru) & set(free) | set(lru) & set(holders)
        assert len(free) + len(lru) + len(holders) == alloc._n


def test_block_accounting_holds_through_random_sharing_and_eviction(tiny):
    """Random prefills over a few shared prefixes (restores, partial hits, evictions under
    pressure) and frees in random order: no block is ever free and held, held twice as its own,
    or leaked."""
    eng = _engine(tiny)
    rng = np.random.default_rng(5)
    ns, stems = _ns_name(), [random_tokens(50 + i, 160) for i in range(2)]
    # all but 40 free blocks away (more than 2 live sequences of up to 220 tokens need): the cache must evict
    hog = types.SimpleNamespace(blocks=eng.blocks.kv.alloc_many(eng.blocks.kv.free_count - 40), draft_blocks=[])
    live: list = []
    restored, evictions = 0, eng.blocks.prefix.kv.evictions if eng.blocks.prefix else 0
    try:
        for _ in range(20):
            if len(live) == 2 or (live and rng.random() < 0.35):
                eng.free_sequence(live.pop(int(rng.integers(len(live)))))
            else:
                s = eng.alloc_sequence(ns)
                stem = stems[int(rng.integers(2))][: 32 * int(rng.integers(2, 6))]
                eng.prefill(s, stem + random_tokens(int(rng.integers(1000)), int(rng.integers(1, 60))), 32)
                live.append(s)
                restored += s.restored_at > 0
            _check_accounting(eng, [*live, hog])
    finally:
        for s in reversed(live):
            eng.free_sequence(s)
        eng.blocks.kv.free_many(hog.blocks)
    _check_accounting(eng, [])
    assert restored >= 3 and eng.blocks.prefix.kv.evictions > evictions


def test_the_branch_point_of_a_shared_prefix_gets_a_snapshot(tiny):
    """A's snapshot lies past the system prompt it shares with B, so B computes, but B's prefill
    ends a program where it leaves A's cached blocks: C, sharing the same system prompt, restores
    there, byte-identical to C computed split at that position."""
    eng = _engine(tiny)
    ns, system = _ns_name(), random_tokens(60, 56)
    seqs, outs = [], []
    try:
        for i in range(3):
            s = eng.alloc_sequence(ns)
            outs.append(eng.prefill(s, system + random_tokens(61 + i, 9)))
            seqs.append(s)
        assert [s.restored_at for s in seqs] == [0, 0, 48]
        ref, r = _computed(eng, seqs[2].tokens, 48, None)
        seqs.append(r)
        np.testing.assert_array_equal(outs[2], ref)
        _assert_same_state(eng, seqs[2], r)
    finally:
        for s in reversed(seqs):
            eng.free_sequence(s)
