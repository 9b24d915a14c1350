"""Paged attention kernel under the CPU interpreter against `kernels_pallas.paged_attention.reference`.

Claims: on decode, verify and prefill-chunk rows (ragged, padded, non-contiguous block tables,
GQA 2:1 and 8:1, float32 and bfloat16) the kernel stays within the declared bounded allowance of
the float64 oracle; padding rows are exact zeros; every output is written; NaN in other sequences'
blocks, in unused blocks and in the own blocks past a sequence's last position leaves every result
bit-identical; row blocks that stop at their own last row stay within the bound; refusals carry a
reason. (Bytes across different row blockings are not a claim: XLA CPU dots are not M-invariant.)
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernels_pallas import common, testing
from kernels_pallas.common import KernelRefused
from kernels_pallas.paged_attention import api, reference

D, BS, NB, MB = 16, 4, 40, 8  # 32 positions per sequence
SCALE = D**-0.5
DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}
CASES = {  # name: (T, starts): a start (s, n) keeps n rows; -1 = an all-padding sequence
    "decode": (1, [5, 17, -1]),
    "verify": (4, [3, (13, 2), 28]),
    "prefill_chunk": (20, [0, 8, (0, 11)]),
}
ref_attention = jax.jit(reference.paged_attention, static_argnums=5)


@functools.cache
def _kernel(block_rows=None):
    return jax.jit(functools.partial(api.paged_attention, scale=SCALE, interpret=True, block_rows=block_rows))


def _inputs(case, h, kvh, dtype, seed=0):
    t, starts = CASES[case]
    rng = np.random.default_rng(seed)
    return testing.attention_inputs(rng, DTYPES[dtype], b=3, t=t, h=h, kvh=kvh, d=D, bs=BS, nb=NB, mb=MB, starts=starts)


def _f32(x):
    return np.asarray(x).astype(np.float32)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("h,kvh", [(4, 2), (8, 1)])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_within_bound(case, h, kvh, dtype):
    assert api.CONTRACT == "bounded"
    args = _inputs(case, h, kvh, dtype)
    out = _kernel()(*args)
    assert out.dtype == args[0].dtype and not np.isnan(_f32(out)).any()
    padding = args[4] < 0
    assert (_f32(out)[padding] == 0).all()
    o64 = testing.attention_oracle(*args, SCALE)
    err, err_ref = testing.rel_err(out, o64), testing.rel_err(ref_attention(*args, SCALE), o64)
    assert err <= common.contract_bound(err_ref, out.dtype), (err, err_ref)


@pytest.mark.parametrize("case", ["verify", "prefill_chunk"])
def test_nan_outside_live_keys_not_read(case):
    q, kc, vc, tables, positions = _inputs(case, 8, 2, "bf16", seed=1)
    clean = _f32(_kernel()(q, kc, vc, tables, positions))
    # Poison every key slot that no valid row may read: unused blocks, the own blocks past each
    # sequence's last position (stale draft rows), and all of the padding sequence's blocks.
    live = np.zeros((NB, BS), bool)
    for i in range(tables.shape[0]):
        last = positions[i].max()
        for p in range(last + 1):
            live[tables[i, p // BS], p % BS] = True
    poisoned = [np.where(live[:, :, None, None], x, np.nan).astype(x.dtype) for x in (kc, vc)]
    out = _f32(_kernel()(q, *poisoned, tables, positions))
    np.testing.assert_array_equal(out, clean)
    # A sequence of padding rows whose blocks are all NaN outputs zeros and disturbs nobody.
    positions_pad = positions.copy()
    positions_pad[1] = -1
    others = np.where(np.isin(np.arange(NB), tables[1])[:, None, None, None], np.nan, kc).astype(kc.dtype)
    out = _f32(_kernel()(q, others, vc, tables, positions_pad))
    assert (out[1] == 0).all()
    np.testing.assert_array_equal(out[[0, 2]], clean[[0, 2]])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_row_blocks_within_bound(dtype):
    """80 rows per kv head in blocks of 16: each block walks the keys up to its own last row."""
    args = _inputs("prefill_chunk", 4, 2, dtype, seed=2)
    out = _kernel(16)(*args)
    o64 = testing.attention_oracle(*args, SCALE)
    err, err_ref = testing.rel_err(out, o64), testing.rel_err(ref_attention(*args, SCALE), o64)
    assert err <= common.contract_bound(err_ref, out.dtype), (err, err_ref)


def test_kv_write_is_the_reference_scatter():
    assert api.write_kv is reference.write_kv


# ---------------------------------------------------------------- refusals


def _shapes(b=4, t=4, h=16, kvh=2, d=256, bs=16, nb=64, mb=32, dtype=jnp.bfloat16):
    s = jax.ShapeDtypeStruct
    return s((b, t, h, d), dtype), s((nb, bs, kvh, d), dtype), s((nb, bs, kvh, d), dtype), s((b, mb), jnp.int32), s((b, t), jnp.int32)


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
        api.paged_attention(q[:, :, :3], kc, vc, tables, positions, SCALE, interpret=True)
