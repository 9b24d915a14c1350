"""The Pallas kernels' batch-invariant configuration (`invariant=True`, the `pallas` forward under
`--batch-invariant`) under the interpreter, at tiny shapes.

Claims:
- Paged attention: a query row's output has the same bits alone and inside batches of 2 to 16 rows (other
  sequences around it, other rows of its own sequence before and after it, padding rows after it), and the
  kernel equals the reference's invariant walk bit for bit. Control: the kernel's default interpreted blocking
  (all of a kv head's rows in one program, a block that grows with the query count) changes a row's bits
  once the rows of a verify outgrow the invariant block (GQA 8:1, 8 rows); at 2:1 it happens to be invariant
  too (not a claim).
- GDN rows kernel: verify row j has the bits of the decode of that row from the state after rows 0..j-1 (output
  and state), a sequence the same bits at any place in a batch of 2 to 8, and the kernel equals the reference's
  invariant recurrence bit for bit. Control: the `xla` forward's default recurrence (batched einsums) differs
  from the decode from row 1 on. (The default interpreted kernel happens to be row-invariant here too: its
  [dk, bv] matvec has one shape whatever the rows; not a claim.)
- Outside the configuration the kernels' programs are their defaults (`PallasOps().batch_invariant` is False).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from kernels_pallas import testing
from kernels_pallas.gdn import api as gdn_api
from kernels_pallas.gdn import reference as gdn_ref
from kernels_pallas.ops import PallasInvariantOps, PallasOps
from kernels_pallas.paged_attention import api as attn_api
from kernels_pallas.paged_attention import pallas_gpu
from kernels_pallas.paged_attention import reference as attn_ref

D, H, KVH, BS, NB, MB = 16, 16, 2, 4, 128, 40  # GQA 8:1: a verify of 8 rows is 64 rows of a kv head
SCALE = D**-0.5
POSITION = 100  # the row's position: two 64-key tiles
DK, DV, GDN_HK, GDN_H = 16, 32, 2, 4
# (sequences B, rows T, the row's sequence i, its row j, real rows of its sequence): rows after the real ones pad
ATTN_BATCHES = [(1, 2, 0, 1, 2), (1, 4, 0, 2, 3), (3, 1, 2, 0, 1), (2, 8, 1, 5, 6), (1, 8, 0, 0, 1), (4, 2, 3, 0, 1)]


def _attention(invariant: bool):
    return jax.jit(functools.partial(attn_api.paged_attention, scale=SCALE, interpret=True, invariant=invariant))


@functools.cache
def _attention_pool():
    rng = np.random.default_rng(0)
    k_cache, v_cache = (rng.standard_normal((NB, BS, KVH, D)).astype(np.float32) for _ in range(2))
    return k_cache, v_cache, rng.permutation(NB), rng.standard_normal((H, D)).astype(np.float32)


def _attention_batch(b, t, i, j, n):
    """Attention inputs with the row (query `q0` at `POSITION`, the first MB blocks of the pool's permutation)
    at sequence i, row j: rows j - n + 1.. of its sequence around it, padding after them, other sequences of
    random rows over other blocks."""
    k_cache, v_cache, perm, q0 = _attention_pool()
    rng = np.random.default_rng(b * 100 + t * 10 + j)
    q = rng.standard_normal((b, t, H, D)).astype(np.float32)
    q[i, j] = q0
    tables = np.stack([rng.choice(perm[MB:], MB) for _ in range(b)]).astype(np.int32)
    positions = np.full((b, t), -1, np.int32)
    for s in range(b):
        m = int(rng.integers(1, t + 1))
        positions[s, :m] = int(rng.integers(0, 150 - t)) + np.arange(m)
    positions[i] = -1
    positions[i, :n] = POSITION - j + np.arange(n)
    tables[i] = perm[:MB]
    return q, k_cache, v_cache, tables, positions


def _row_bits(fn, batch) -> list[bool]:
    """For each batch of `ATTN_BATCHES`: whether the row's output has its bits alone."""
    alone = np.asarray(fn(*_attention_batch(1, 1, 0, 0, 1)))[0, 0]
    return [np.asarray(fn(*_attention_batch(*c)))[c[2], c[3]].tobytes() == alone.tobytes() for c in batch]


def test_attention_row_alone_equals_the_row_in_any_batch():
    assert _row_bits(_attention(True), ATTN_BATCHES) == [True] * len(ATTN_BATCHES)


def test_attention_default_blocking_is_the_control():
    """The control: the default blocking (a kv head's rows in one program) changes the row's bits in a block
    of 64 rows (8 rows of 8 query heads), where the invariant configuration keeps blocks of 16."""
    assert not all(_row_bits(_attention(False), ATTN_BATCHES))


def test_attention_equals_the_invariant_reference():
    ref = jax.jit(functools.partial(attn_ref.paged_attention, scale=SCALE, invariant=True))
    for c in ATTN_BATCHES[3:5]:
        args = _attention_batch(*c)
        assert np.asarray(_attention(True)(*args)).tobytes() == np.asarray(ref(*args)).tobytes(), c


@functools.cache
def _gdn_inputs(b: int, seed: int):
    args = testing.gdn_inputs(np.random.default_rng(seed), b, 8, GDN_HK, GDN_H, DK, DV, initial_state=True)
    return [np.asarray(x) for x in args]


def _verify_rows_are_decodes(fn) -> list[bool]:
    """Row j of one sequence's 8-row verify against the decode of row j from the state after row j - 1."""
    seq = [x[:1] for x in _gdn_inputs(1, 0)]
    o, states = map(np.asarray, fn(*seq))
    same = []
    for j in range(8):
        h0 = seq[5] if j == 0 else states[:, j - 1]
        o1, s1 = map(np.asarray, fn(*[x[:, j : j + 1] for x in seq[:5]], h0))
        same.append(o1[0, 0].tobytes() == o[0, j].tobytes() and s1[0, 0].tobytes() == states[0, j].tobytes())
    return same


def _gdn(invariant: bool):
    return jax.jit(functools.partial(gdn_api.recurrent_gated_delta_rule, interpret=True, invariant=invariant))


def test_gdn_verify_row_equals_the_decode_and_the_batch_does_not_matter():
    fn = _gdn(True)
    assert _verify_rows_are_decodes(fn) == [True] * 8
    seq = [x[:1] for x in _gdn_inputs(1, 0)]
    o, states = map(np.asarray, fn(*seq))
    for b in (2, 5, 8):
        args = [x.copy() for x in _gdn_inputs(b, b)]
        for a, x in zip(args, seq):
            a[b // 2] = x[0]
        ob, sb = map(np.asarray, fn(*args))
        assert ob[b // 2].tobytes() == o[0].tobytes() and sb[b // 2].tobytes() == states[0].tobytes(), b
    ref_o, ref_states = map(
        np.asarray, jax.jit(functools.partial(gdn_ref.recurrent_gated_delta_rule, invariant=True))(*seq)
    )
    assert ref_o.tobytes() == o.tobytes() and ref_states.tobytes() == states.tobytes()


def test_gdn_default_recurrence_is_the_control():
    assert not all(_verify_rows_are_decodes(jax.jit(gdn_ref.recurrent_gated_delta_rule)))


def test_the_configuration_is_the_modes_only():
    assert PallasOps().batch_invariant is False and PallasInvariantOps().batch_invariant is True
    assert PallasInvariantOps().name != PallasOps().name


def test_the_invariant_forms_run_interpreted_only():
    args = _attention_batch(1, 1, 0, 0, 1)
    tiling = pallas_gpu.AttentionTiling.get_invariant(BS)
    with pytest.raises(ValueError, match="interpreter"):
        pallas_gpu.paged_attention(*args, SCALE, tiling=tiling, interpret=False, form="invariant")
