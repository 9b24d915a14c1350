"""Paged attention kernel against `kernels_pallas.paged_attention.reference`: under the Pallas
interpreter off GPU, compiled through Triton on a GPU (`INTERPRET`), from the same test bodies.

Claims: on decode, verify and prefill-chunk rows spanning one to three 64-key tiles (ragged, padded,
rows crossing a tile boundary, non-contiguous block tables, GQA 2:1 and 8:1 and MHA, float32 and
bfloat16) the kernel with its default tiling and form meets its contract (BYTE-EQUAL to the
reference under the interpreter, within the bounded allowance when compiled); padding rows are
exact zeros; NaN in other sequences' blocks, in unused blocks and in the own blocks past a
sequence's last position leaves every result bit-identical, in the kernel and in the reference
alike. The tiled reference is as accurate as the whole-span softmax (kept here as the yardstick)
against the float64 oracle, and `reductions.pairwise_sum` gives a row the same bytes at any array
shape. The Triton form (tl.sum, q-dtype dots) and GPU-sized row blocks stay within the bounded
allowance (on CPU too). (Bytes across different row blockings are not a claim: XLA CPU dots are not
M-invariant.)
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernels_pallas import common, reductions, testing
from kernels_pallas.common import KernelRefused
from kernels_pallas.paged_attention import api, pallas_gpu, reference
from kernels_pallas.paged_attention.pallas_gpu import AttentionTiling

D, BS, NB, MB = 16, 4, 128, 40  # 160 positions per sequence: tiles of 64 keys (16 blocks), up to 3
SCALE = D**-0.5
DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}
CASES = {  # name: (T, starts): a start (s, n) keeps n rows; -1 = an all-padding sequence
    "decode": (1, [5, 150, -1]),
    "verify": (4, [3, (70, 2), 140]),
    "prefill_chunk": (20, [0, 50, (120, 11)]),  # rows 50..69 cross the first tile boundary
}
HEADS = [(4, 2), (8, 1)]
INTERPRET = common.default_interpret()  # the interpreter off GPU; compiled through Triton on a GPU
ref_attention = jax.jit(reference.paged_attention, static_argnums=5)


@functools.cache
def _kernel(block_rows=None, form=None):
    tiling = None if block_rows is None else AttentionTiling(block_rows=block_rows, pages=reference.tile_pages(BS))
    return jax.jit(functools.partial(api.paged_attention, scale=SCALE, interpret=INTERPRET, tiling=tiling, form=form))


def _inputs(case, h, kvh, dtype, seed=0):
    t, starts = CASES[case]
    rng = np.random.default_rng(seed)
    return testing.attention_inputs(rng, DTYPES[dtype], b=3, t=t, h=h, kvh=kvh, d=D, bs=BS, nb=NB, mb=MB, starts=starts)


def _f32(x):
    return np.asarray(x).astype(np.float32)


def _assert_bytes_equal(x, y):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    bits = np.dtype(f"u{x.dtype.itemsize}")
    np.testing.assert_array_equal(x.view(bits), y.view(bits))


def _assert_meets_contract(out, ref, args):
    """The kernel's output against the reference's: bytes under the interpreter, bounded compiled."""
    oracle = lambda: testing.attention_oracle(*args, SCALE)
    testing.assert_contract(out, ref, oracle, interpret=INTERPRET, assert_equal=_assert_bytes_equal)


def _whole_span_attention(q, k_cache, v_cache, block_tables, positions, scale):
    """A whole-span reference: one softmax over each row's whole table span, normalised before the
    PV product; the accuracy yardstick of the tiled reference."""
    b, t, h, d = q.shape
    nb, bs, kvh, _ = k_cache.shape
    mb = block_tables.shape[1]
    keys = k_cache[block_tables].reshape(b, mb * bs, kvh, d).astype(q.dtype)  # [B, S, KV, D]
    vals = v_cache[block_tables].reshape(b, mb * bs, kvh, d).astype(q.dtype)
    span = jnp.arange(mb * bs)
    live = span[None, :] <= jnp.max(positions, axis=1)[:, None]  # [B, S]
    keys = jnp.where(live[:, :, None, None], keys, 0)
    vals = jnp.where(live[:, :, None, None], vals, 0)
    qg = q.reshape(b, t, kvh, h // kvh, d)
    scores = jnp.einsum("btgrd,bsgd->btgrs", qg, keys, preferred_element_type=jnp.float32)
    scores = (scores.astype(q.dtype) * jnp.asarray(scale, q.dtype)).astype(jnp.float32)
    mask = span[None, None, :] <= positions[:, :, None]  # [B, T, S]
    scores = jnp.where(mask[:, :, None, None, :], scores, -jnp.inf)
    valid = positions >= 0
    scores = jnp.where(valid[:, :, None, None, None], scores, 0.0)
    e = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    probs = (e / jnp.sum(e, axis=-1, keepdims=True)).astype(q.dtype)
    out = jnp.einsum("btgrs,bsgd->btgrd", probs, vals, preferred_element_type=jnp.float32)
    out = jnp.where(valid[:, :, None, None, None], out, 0.0)
    return out.reshape(b, t, h, d).astype(q.dtype)


whole_span_attention = jax.jit(_whole_span_attention, static_argnums=5)


# ---------------------------------------------------------------- the contract: bytes


@pytest.mark.parametrize(
    "case,h,kvh",
    [(c, h, kvh) for c in CASES for h, kvh in HEADS] + [("decode", 2, 2)],  # MHA decode: one-row matrices
)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_bit_identical(case, h, kvh, dtype):
    assert api.CONTRACT == "bit-identical"
    args = _inputs(case, h, kvh, dtype)
    out = _kernel()(*args)
    assert out.dtype == args[0].dtype and not np.isnan(_f32(out)).any()
    assert (_f32(out)[args[4] < 0] == 0).all()
    _assert_meets_contract(out, ref_attention(*args, SCALE), args)


@pytest.mark.parametrize("case", ["verify", "prefill_chunk"])
def test_nan_outside_live_keys_not_read(case):
    q, kc, vc, tables, positions = args = _inputs(case, 8, 2, "bf16", seed=1)
    clean, ref_clean = _kernel()(*args), ref_attention(*args, SCALE)
    _assert_meets_contract(clean, ref_clean, args)
    # Poison every key slot that no valid row may read: unused blocks, the own blocks past each
    # sequence's last position (stale draft rows), and all of the padding sequence's blocks.
    live = np.zeros((NB, BS), bool)
    for i in range(tables.shape[0]):
        for p in range(positions[i].max() + 1):
            live[tables[i, p // BS], p % BS] = True
    poisoned = [np.where(live[:, :, None, None], x, np.nan).astype(x.dtype) for x in (kc, vc)]
    _assert_bytes_equal(_kernel()(q, *poisoned, tables, positions), clean)
    _assert_bytes_equal(ref_attention(q, *poisoned, tables, positions, SCALE), ref_clean)
    # A sequence of padding rows whose blocks are all NaN outputs zeros and disturbs nobody.
    positions_pad = positions.copy()
    positions_pad[1] = -1
    others = np.where(np.isin(np.arange(NB), tables[1])[:, None, None, None], np.nan, kc).astype(kc.dtype)
    for out, unpadded in (
        (_kernel()(q, others, vc, tables, positions_pad), clean),
        (ref_attention(q, others, vc, tables, positions_pad, SCALE), ref_clean),
    ):
        assert (_f32(out)[1] == 0).all()
        _assert_bytes_equal(np.asarray(out)[[0, 2]], np.asarray(unpadded)[[0, 2]])


# ---------------------------------------------------------------- the reference's accuracy


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_tiled_reference_as_accurate_as_whole_span(dtype):
    """Against the float64 oracle, over every case and head layout: the tiled reference's RMS error
    (pooled over all valid rows) is at most the whole-span softmax's, and each case's max error is
    at most the whole-span's plus one unit roundoff of the dtype (the max is a single element's
    last-bit luck either way)."""
    u = float(jnp.finfo(DTYPES[dtype]).eps) / 2
    sq = {"tiled": 0.0, "whole": 0.0}
    n = 0
    for case in CASES:
        for h, kvh in HEADS + [(2, 2)]:
            args = _inputs(case, h, kvh, dtype)
            o64 = testing.attention_oracle(*args, SCALE)
            norm, valid = np.abs(o64).max(), args[4] >= 0
            errs = {}
            for name, fn in (("tiled", ref_attention), ("whole", whole_span_attention)):
                e = (np.asarray(fn(*args, SCALE), np.float64) - o64)[valid] / norm
                sq[name] += float((e**2).sum())
                errs[name] = float(np.abs(e).max())
            n += int(valid.sum()) * h * D
            assert errs["tiled"] <= errs["whole"] + u, (case, h, kvh, errs)
    # NOTE: a 5 % margin: an AMD EPYC host measured tiled / whole mean square 1.02 (2.12e-8 vs 2.10e-8 rms).
    assert sq["tiled"] <= 1.05 * sq["whole"], {k: (v / n) ** 0.5 for k, v in sq.items()}


def test_pairwise_sum_is_shape_invariant():
    """`reductions.pairwise_sum` gives a row the same bytes whatever array it sits in (jnp.sum does not
    on XLA CPU), for power-of-two and other tile lengths, and is a correctly bounded sum."""
    rng = np.random.default_rng(3)
    for n in (64, 60):
        x = rng.uniform(size=(3, 2, 40, n)).astype(np.float32)
        batched = np.asarray(jax.jit(reductions.pairwise_sum)(x))
        one_block = np.asarray(jax.jit(reductions.pairwise_sum)(x[1, 0]))
        _assert_bytes_equal(one_block, batched[1, 0])
        exact = x.astype(np.float64).sum(-1)
        assert np.abs(batched - exact).max() <= np.log2(n) * np.finfo(np.float32).eps * exact.max()


# ---------------------------------------------------------------- bounded parts: other tilings and the Triton body


@pytest.mark.parametrize("block_rows,form", [(16, "reference"), (16, "triton")])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_other_tilings_within_bound(block_rows, form, dtype):
    """80 rows per kv head in blocks of 16 (each block walks the keys up to its own last row),
    with the interpreter's body and with the Triton body (tl.sum, q-dtype dots): within the bound.
    The "reference" body is the interpreter's (Triton cannot slice a tile), so compiled runs only
    the "triton" one."""
    if form == "reference" and not INTERPRET:
        pytest.skip("the reference form is the interpreter's body")
    args = _inputs("prefill_chunk", 8, 2, dtype, seed=2)
    out = _kernel(block_rows, form)(*args)
    assert (_f32(out)[args[4] < 0] == 0).all()
    o64 = testing.attention_oracle(*args, SCALE)
    err, err_ref = testing.rel_err(out, o64), testing.rel_err(ref_attention(*args, SCALE), o64)
    assert err <= common.contract_bound(err_ref, out.dtype), (err, err_ref)


def test_default_tiling():
    """Interpreter: one program holds all of a kv head's rows (at least MIN_ROWS), as the
    reference's row matrix; GPU: power-of-two row blocks in [16, 64]; key tiles of TILE_KEYS."""
    tiling = lambda *dims, interpret: dataclasses.astuple(AttentionTiling.get_default(*dims, interpret=interpret))[:2]
    assert tiling(20, 8, 2, 4, interpret=True) == (80, 16)
    assert tiling(1, 2, 2, 16, interpret=True) == (reference.MIN_ROWS, 4)
    assert tiling(1, 16, 2, 16, interpret=False) == (16, 4)
    assert tiling(512, 16, 2, 16, interpret=False) == (64, 4)
    assert tiling(4, 16, 2, 128, interpret=False) == (32, 1)
    assert pallas_gpu.default_form(True) == "reference" and pallas_gpu.default_form(False) == "triton"


def test_kv_write_is_the_reference_scatter():
    assert api.write_kv is reference.write_kv


# ---------------------------------------------------------------- refusals


def _shapes(b=4, t=4, h=16, kvh=2, d=256, bs=16, nb=64, mb=32, dtype=jnp.bfloat16):
    return testing.attention_abstract_args(b, t, h, kvh, d, bs=bs, nb=nb, mb=mb, dtype=dtype)


def test_supported_at_model_shapes():
    for h, kvh, d in ((8, 1, 128), (16, 2, 256)):
        for t in (1, 4, 512):
            for backend in common.BACKENDS:
                assert api.paged_attention_supported(*_shapes(t=t, h=h, kvh=kvh, d=d), backend=backend) is None


@pytest.mark.parametrize(
    "kw,backend,needle",
    [
        (dict(d=96), "gpu", "head_dim=96"),
        (dict(bs=12), "gpu", "tile_keys="),
        (dict(h=12, kvh=8), "interpret", "not a multiple of kv heads"),
        (dict(dtype=jnp.int8), "interpret", "q dtype"),
        (dict(nb=2**20), "gpu", "int32"),
        ({}, "tpu", "no Pallas kernel"),
    ],
)
def test_refusals_carry_reasons(kw, backend, needle):
    reason = api.paged_attention_supported(*_shapes(**kw), backend=backend)
    assert reason is not None and needle in reason, reason


def test_refused_kernel_raises():
    q, kc, vc, tables, positions = _inputs("decode", 4, 2, "f32")
    with pytest.raises(KernelRefused, match="kv heads"):
        api.paged_attention(q[:, :, :3], kc, vc, tables, positions, SCALE, interpret=INTERPRET)
    with pytest.raises(ValueError, match="form"):
        api.paged_attention(q, kc, vc, tables, positions, SCALE, interpret=INTERPRET, form="sorted")


@pytest.mark.parametrize("case", ["decode", "verify"])
def test_stacked_cache_reads_the_layer(case):
    """The reference reading a stacked [L, NB, ...] cache at `layer` (static or traced, as in the
    scan layout) gives the bytes of the same layer's cache passed alone; other layers hold NaN."""
    q, kc, vc, tables, positions = _inputs(case, 8, 2, "f32", seed=2)
    alone = ref_attention(q, kc, vc, tables, positions, SCALE)
    nan = np.full_like(kc, np.nan)
    kst, vst = np.stack([nan, kc, nan]), np.stack([nan, vc, nan])
    static = jax.jit(functools.partial(reference.paged_attention, scale=SCALE, layer=1))
    traced = jax.jit(functools.partial(reference.paged_attention, scale=SCALE))
    _assert_bytes_equal(static(q, kst, vst, tables, positions), alone)
    _assert_bytes_equal(traced(q, kst, vst, tables, positions, layer=jnp.int32(1)), alone)
