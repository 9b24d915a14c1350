"""Property tests (hypothesis) of the verify's acceptance over random tokens, argmaxes, lengths and K.

The device acceptance (`transitions.greedy_accepts` on `_grid`'s rows, as the fused step runs it)
must equal the host's (`speculative.accepted_drafts`, what `Engine.accept` and the diff use) for any
ragged batch the engine builds (`batching.step_batch`), argmaxes drawn with weight on the edge ids
(0, the last id) that a value-gated bug needs. The padding sentinel (`inputs.PAD_TOKEN`) must never
agree with an argmax, so acceptance that strays one column past a sequence's rows (the planted
`mutant-accept-past-lens`) still counts right: the collision of a padding token with an argmax of 0
cannot happen. The confidence stop (`DraftSchedule.cut`) keeps exactly the drafts before the first
below it.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
from conftest import settings
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from metrale_jax.engine.batching import step_batch
from metrale_jax.engine.capacity import pool_counts
from metrale_jax.engine.inputs import PAD_TOKEN, StepBatch
from metrale_jax.engine.sequences import SequenceState
from metrale_jax.engine.speculative import DraftSchedule, accepted_drafts
from metrale_jax.engine.transitions import _grid, greedy_accepts
from metrale_jax.presets import resolve_checkpoint

VOCAB = 256
CFG, _ = resolve_checkpoint("tiny")
COUNTS = pool_counts(settings(max_batch_size=8, max_seq_len=64, speculative=True, num_drafts=3), CFG)
K = COUNTS.k


def edge_ids(vocab: int = VOCAB):
    """Token ids with the edges (0, 1, the last) drawn often."""
    return st.one_of(st.sampled_from([0, 1, vocab - 1]), st.integers(0, vocab - 1))


@st.composite
def verify_batches(draw):
    """(sequences' rows [last, drafts..], each row's argmax): 1..8 sequences of 1..K rows."""
    n = draw(st.integers(1, 8))
    lens = draw(st.lists(st.integers(1, K), min_size=n, max_size=n))
    rows = [draw(st.lists(edge_ids(), min_size=k, max_size=k)) for k in lens]
    # argmaxes that agree with the next draft for a random prefix, then anything (0 included)
    argmax = []
    for r in rows:
        agree = draw(st.integers(0, len(r)))
        argmax.append([r[i + 1] if i + 1 < len(r) and i < agree else draw(edge_ids()) for i in range(len(r))])
    return rows, argmax


def _device_accepts(rows, argmax, accepts=greedy_accepts) -> np.ndarray:
    seqs = [SequenceState(seq_id=i, slot=i, seq_len=4) for i in range(len(rows))]
    batch, r = step_batch(COUNTS, seqs, rows, verify=True)
    flat = np.zeros(batch.row_index.shape[0], np.int32)
    flat[:r] = [a for am in argmax for a in am]
    grid = _grid(jnp.asarray(flat), jnp.asarray(batch.lens), batch.tokens.shape[1])
    return np.asarray(accepts(jnp.asarray(batch.tokens), grid, jnp.asarray(batch.lens)))[: len(rows)]


def accepts_past_lens(tokens, argmax, lens):
    """The planted off-by-one: agreement counted up to column lens inclusive."""
    t = tokens.shape[1]
    agree = (argmax[:, :-1] == tokens[:, 1:]) & (jnp.arange(1, t, dtype=jnp.int32)[None, :] <= lens[:, None])
    return jnp.sum(jnp.cumprod(agree.astype(jnp.int32), axis=1), axis=1, dtype=jnp.int32)


def test_padding_carries_a_token_no_id_or_argmax_takes():
    batch = StepBatch.padded(COUNTS, COUNTS.draft_table_width, 8, K, verify=True)
    assert PAD_TOKEN < 0 and (batch.tokens == PAD_TOKEN).all()
    seqs = [SequenceState(seq_id=0, slot=0, seq_len=4)]
    filled, _ = step_batch(COUNTS, seqs, [[5, 0]], verify=True)
    assert filled.tokens[0, :2].tolist() == [5, 0] and (filled.tokens[0, 2:] == PAD_TOKEN).all()


@hsettings(max_examples=150, deadline=None)
@given(verify_batches())
def test_device_acceptance_equals_the_hosts(batch):
    rows, argmax = batch
    want = [accepted_drafts(r, a) for r, a in zip(rows, argmax)]
    got = _device_accepts(rows, argmax)
    assert got.tolist() == want
    assert all(0 <= g <= len(r) - 1 for g, r in zip(got, rows))


@hsettings(max_examples=100, deadline=None)
@given(verify_batches())
def test_a_full_accept_below_k_max_cannot_collide_with_padding(batch):
    """Every draft accepted and the last row's argmax 0 (the padding id before the sentinel): an
    acceptance that reads one padding column too many still counts the sequence's drafts only."""
    rows, argmax = batch
    for r, a in zip(rows, argmax):
        a[: len(r) - 1] = r[1:]
        a[-1] = 0
    want = [len(r) - 1 for r in rows]
    assert _device_accepts(rows, argmax).tolist() == want
    assert _device_accepts(rows, argmax, accepts_past_lens).tolist() == want


@hsettings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(-8.0, 0.0, width=32), min_size=1, max_size=4),
    st.floats(-8.0, 0.0, width=32),
    st.integers(0, 4),
)
def test_the_confidence_stop_keeps_exactly_the_drafts_before_the_first_below_it(confidences, stop, keep):
    conf = np.asarray(confidences, np.float32)
    drafts = np.arange(len(conf), dtype=np.int32) + 7
    kept, kept_conf = DraftSchedule(4, None, stop).cut(drafts, conf, keep)
    n = len(kept)
    assert kept == drafts[:n].tolist() and n <= min(keep, len(conf))
    assert all(c >= stop for c in kept_conf), "no kept draft lies below the stop"
    assert n == min(keep, len(conf)) or conf[n] < stop, "a draft is cut only at the first below the stop"


def test_the_planted_stop_mutant_keeps_a_draft_below_the_stop():
    from diff_mutants import planted_coverage

    engine = SimpleNamespace(blocks=SimpleNamespace(prefix=None), save_sequence_state=None)
    conf = np.asarray([-1.0, -5.0, -1.0], np.float32)
    with planted_coverage(engine, "stop-keeps-one-below"):
        kept, _ = DraftSchedule(3, None, -2.0).cut(np.arange(3), conf, 3)
    assert kept == [0, 1]
    assert DraftSchedule(3, None, -2.0).cut(np.arange(3), conf, 3)[0] == [0]


def test_the_planted_sentinel_mutant_counts_a_padding_row_after_a_full_accept():
    """The `sentinel` coverage mutant's acceptance (padding read as 0, one column past the rows)
    breaks the property above exactly on the collision: a full accept below K_max, last argmax 0."""
    from diff_mutants import colliding_accepts

    rows, argmax = [[5, 9], [5, 9, 7, 3]], [[9, 0], [9, 7, 3, 0]]
    assert _device_accepts(rows, argmax).tolist() == [1, 3]
    assert _device_accepts(rows, argmax, colliding_accepts).tolist() == [2, 3]
    assert _device_accepts(rows, [[9, 4], [9, 7, 3, 0]], colliding_accepts).tolist() == [1, 3]
