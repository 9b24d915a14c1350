"""The block manager (`engine.blocks`) on its own: no engine, no device, no JAX.

Claims:
- Importing the block manager loads neither JAX nor NumPy, and every test of this module passes
  in an interpreter that never imports either (`test_the_block_manager_runs_without_jax`).
- Slots are LIFO; a slot or a sequence freed twice is refused.
- A reservation is all or nothing: a refusal (a sequence given twice, freed, foreign, past
  --max-seq-len, or more blocks than are free) changes no sequence and no free list; a swap-in's
  held count is exact and bounded by --max-seq-len.
- With prefix caching, a prefill's full blocks are cached and its block-aligned ends claim a
  snapshot; freed, the cached blocks wait in the LRU; a fresh sequence with that prefix shares
  them (a refused share gives them back); exhaustion evicts from the LRU only when that suffices;
  a rewind into shared blocks is refused.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
from block_managers import speculative_manager

from metrale_jax.engine.blocks import BlockManager
from metrale_jax.engine.sequences import EngineError

MAX_SEQ_LEN, BLOCK = 64, 16


def _manager(prefix_caching: bool = True, slots: int = 2) -> BlockManager:
    """A speculative serve's manager (an MTP drafter: drafter blocks too) of `slots` slots."""
    return speculative_manager(slots, MAX_SEQ_LEN, BLOCK, prefix_caching)


def _state(m: BlockManager, *seqs) -> tuple:
    """Everything a refusal must leave as it was."""
    return (
        m.slots.live,
        m.kv.free_count,
        m.draft.free_count,
        [(s.blocks[:], s.draft_blocks[:], s.seq_len) for s in seqs],
    )


def _prefilled(m: BlockManager, tokens: list[int], namespace: str = "n"):
    """A sequence after the host side of a cached prefill of `tokens` split at its last full
    block (as the engine splits it): reserve, then `cache` after each program."""
    seq = m.alloc(namespace)
    assert m.lookup(seq, tokens) == (None, 0)
    m.reserve([seq], [len(tokens) + 1])
    snaps = []
    for end in (len(tokens) // BLOCK * BLOCK, len(tokens)):
        seq.seq_len, seq.tokens = end, tokens[:end]
        snaps.append(m.cache(seq))
    return seq, snaps


def test_the_block_manager_runs_without_jax():
    """This module's other tests, run in a fresh interpreter without the suite's conftest (which
    loads JAX for the engine's tests): they pass, and neither JAX nor NumPy was ever imported."""
    me = test_the_block_manager_runs_without_jax.__name__
    probe = f"""
import json, runpy, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
tests = runpy.run_path({str(Path(__file__))!r})
ran = [f() or name for name, f in tests.items() if name.startswith("test_") and name != {me!r}]
print(json.dumps([ran, sorted({{m.split(".")[0] for m in sys.modules}} & {{"jax", "jaxlib", "numpy", "flax"}})]))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    ran, loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert ran == [name for name in globals() if name.startswith("test_") and name != me] and len(ran) >= 4
    assert loaded == []


def test_slots_are_lifo_and_double_frees_are_refused():
    m = _manager(prefix_caching=False)
    a, b = m.alloc(), m.alloc()
    assert (a.slot, b.slot, m.slots.live) == (0, 1, 2)
    with pytest.raises(EngineError, match="no free sequence slot"):
        m.alloc()
    m.free(b)
    m.free(a)
    assert m.alloc().slot == 0
    with pytest.raises(EngineError, match="already freed"):
        m.free(a)
    with pytest.raises(EngineError, match="needs --enable-prefix-caching"):
        m.alloc("n")


def test_a_refused_reservation_changes_nothing():
    m = _manager(prefix_caching=False)
    a, b = m.alloc(), m.alloc()
    m.reserve([a], [17])
    assert (len(a.blocks), len(a.draft_blocks)) == (2, 2)
    before = _state(m, a, b)
    refusals = {
        "given twice": lambda: m.reserve([a, a], [20, 20]),
        "over --max-seq-len 64": lambda: m.reserve([a, b], [20, MAX_SEQ_LEN + 1]),
    }
    for match, call in refusals.items():
        with pytest.raises(EngineError, match=match):
            call()
        assert _state(m, a, b) == before, match
    taken = m.kv.alloc_many(m.kv.free_count - 1)
    before = _state(m, a, b)
    with pytest.raises(EngineError, match="KV blocks exhausted: 3 needed, 1 free"):
        m.reserve([a, b], [33, 32])  # a needs 1 more, b 2: a alone would fit
    assert _state(m, a, b) == before
    m.kv.free_many(taken)
    foreign = types.SimpleNamespace(**{**vars(b), "seq_id": 7})
    with pytest.raises(EngineError, match="not allocated by this engine"):
        m.reserve([foreign], [1])
    m.free(b)
    with pytest.raises(EngineError, match="was freed"):
        m.reserve([b], [1])


def test_a_swap_in_holds_exactly_the_saved_block_counts():
    m = _manager(prefix_caching=False)
    a = m.alloc()
    m.reserve([a], [5], held=(3, 2))
    assert (len(a.blocks), len(a.draft_blocks)) == (3, 2)
    with pytest.raises(EngineError, match=r"exceed this engine's \(4, 4\)"):
        m.reserve([m.alloc()], [5], held=(5, 0))


def test_cached_blocks_are_shared_then_evicted_least_recently_used_first():
    m = _manager()
    assert m.prefix is not None and m.default_namespace == "serve"
    tokens = list(range(40))
    a, snaps = _prefilled(m, tokens)
    assert snaps[0] is not None and (snaps[0].slot, snaps[0].position) == (0, 32) and snaps[1] is None
    assert a.shared_len == 32
    with pytest.raises(EngineError, match="shared prefix-cache blocks"):
        m.rewind(a, 9)
    m.rewind(a, 8)
    assert (a.seq_len, a.tokens) == (32, tokens[:32])
    cached = a.blocks[:2]
    m.free(a)
    assert m.prefix.kv.evictable == 2 and all(m.prefix.kv.refs(x) == 0 for x in cached)

    b = m.alloc("n")
    hit, branch = m.lookup(b, [*tokens, 99])
    assert hit is not None and hit.snapshot.position == 32 and hit.blocks == cached and branch == 32
    assert m.lookup(m.alloc("other"), [*tokens, 99]) == (None, 0), "namespaces share nothing"
    m.share(b, hit, [*tokens, 99])
    assert b.blocks[:2] == cached and len(b.blocks) == 3 and m.prefix.kv.evictable == 0
    assert all(m.prefix.kv.refs(x) == 1 for x in cached)
    m.free(b)

    c = m.alloc("n")
    hit, _ = m.lookup(c, [*tokens, 99])
    assert hit is not None
    hog = m.kv.alloc_many(m.kv.free_count)
    before = _state(m, c), m.prefix.kv.evictable
    with pytest.raises(EngineError, match="KV blocks exhausted: 1 needed, 0 free"):
        m.share(c, hit, [*tokens, 99])  # the hit's blocks are referenced: nothing to evict
    assert (_state(m, c), m.prefix.kv.evictable) == before
    assert all(m.prefix.kv.refs(x) == 0 for x in cached)

    m.make_room(1 + m.prefix.kv.evictable, 0)  # eviction cannot cover it: nothing changes
    assert (m.kv.free_count, m.prefix.kv.evictable) == (0, 2)
    m.reserve([c], [1])  # the free list falls short: the LRU gives its oldest block
    assert (len(c.blocks), m.prefix.kv.evictable, m.prefix.kv.evictions) == (1, 1, 1)
    m.kv.free_many(hog)
