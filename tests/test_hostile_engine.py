"""Engine misuse is an `EngineError` before anything changes, and a swap round trip restores
whatever it saved.

- A sequence given twice in one batch (`decode_batch`, `verify_batched`, `propose_batched`), a
  freed sequence and one this engine never allocated are refused; the host bookkeeping and every
  pool buffer are unchanged afterwards.
- A 98-token sequence under `--max-seq-len 100 --block-size 16` holds 7 blocks (112 positions):
  swapped out, freed and restored into a fresh sequence, it gets its 7 blocks back, and its next
  decode gives the same logits as the original's.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from conftest import settings

from metrale_jax.engine.engine import Engine
from metrale_jax.engine.sequences import EngineError, SequenceState

PROMPT = [int(x) for x in np.random.default_rng(3).integers(0, 256, size=97)]


@pytest.fixture(scope="module")
def eng(tiny):
    cfg, params = tiny
    return Engine(
        cfg, params, settings(max_batch_size=4, max_seq_len=100, block_size=16, speculative=True, num_drafts=3)
    )


def _snapshot(eng, seqs):
    """Everything a refused call must leave alone: host facts and the pool's bytes."""
    host = [(s.seq_len, list(s.blocks), list(s.draft_blocks), list(s.tokens), s.drafter_len) for s in seqs]
    free = (eng.blocks.slots.live, eng.blocks.kv.free_count, eng.blocks.draft.free_count)
    return host, free, [np.asarray(x).copy() for x in jax.tree_util.tree_leaves(eng.pool)]


def _same(a, b):
    assert a[:2] == b[:2]
    for x, y in zip(a[2], b[2]):
        np.testing.assert_array_equal(x, y)


def test_a_sequence_twice_in_one_batch_is_refused_before_anything_changes(eng):
    a = eng.alloc_sequence()
    eng.prefill(a, PROMPT[:9])
    before = _snapshot(eng, [a])
    for call in (
        lambda: eng.decode_batch([a, a], [1, 2]),
        lambda: eng.verify_batched([a, a], [1, 2, 3, 4, 5, 6], [3, 3]),
        lambda: eng.propose_batched([a, a], [1, 1], 1),
    ):
        with pytest.raises(EngineError, match="given twice"):
            call()
        _same(_snapshot(eng, [a]), before)
    assert a.seq_len == 9
    eng.free_sequence(a)


def test_freed_and_foreign_sequences_are_refused_before_anything_changes(eng):
    live = eng.alloc_sequence()
    eng.prefill(live, PROMPT[:5])
    gone = eng.alloc_sequence()
    eng.free_sequence(gone)
    before = _snapshot(eng, [live])
    cases = (
        ([live, gone], "was freed"),
        ([live, SequenceState(seq_id=10**6, slot=1)], "not allocated by this engine"),
        ([live, SequenceState(seq_id=live.seq_id + 1, slot=live.slot)], "given twice"),
        ([SequenceState(seq_id=live.seq_id, slot=99)], "not allocated by this engine"),
    )
    for seqs, message in cases:
        with pytest.raises(EngineError, match=message):
            eng.decode_batch(seqs, [1] * len(seqs))
        _same(_snapshot(eng, [live]), before)
    eng.free_sequence(live)


def test_swap_round_trip_restores_the_blocks_it_saved(eng):
    seq = eng.alloc_sequence()
    eng.prefill(seq, PROMPT)
    eng.decode(seq, 5)
    assert (seq.seq_len, len(seq.blocks)) == (98, 7)  # 112 positions under --max-seq-len 100
    record = eng.save_sequence_state(seq)
    want = eng.decode(seq, 6)
    eng.free_sequence(seq)
    back = eng.alloc_sequence()
    eng.restore_sequence_state(back, record)
    assert (back.seq_len, len(back.blocks), len(back.draft_blocks)) == (98, 7, record.draft_blocks)
    np.testing.assert_array_equal(eng.decode(back, 6), want)
    with pytest.raises(EngineError, match="freshly allocated"):
        eng.restore_sequence_state(back, record)
    eng.free_sequence(back)
    fresh = eng.alloc_sequence()
    before = _snapshot(eng, [fresh])
    for bad, message in (
        (dataclasses.replace(record, seq_len=101), "over --max-seq-len"),
        (dataclasses.replace(record, blocks=8), "exceed this engine's"),
    ):
        with pytest.raises(EngineError, match=message):
            eng.restore_sequence_state(fresh, bad)
        _same(_snapshot(eng, [fresh]), before)
    eng.free_sequence(fresh)
