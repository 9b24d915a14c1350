"""Gated DeltaNet kernels against `kernels_pallas.gdn.reference`: under the Pallas interpreter off
GPU, compiled through Triton on a GPU (`INTERPRET`), from the same test bodies.

Claims: the two references agree (chunk vs recurrent, f32 <= 1e-5 relative); both kernels meet
their contract (byte-equal to their reference under the interpreter, within the bounded allowance
against the float64 oracle when compiled) on random, ragged (identity-row padded) batches, with and
without an initial state, T on and off the chunk boundary, GVA ratios 1 and 2; the Triton body
(multiply + sum matvecs) and narrow value tiles stay within the bounded allowance against the
float64 oracle; every output element is written; refusals carry a reason.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from kernels_pallas import common, testing
from kernels_pallas.common import KernelRefused
from kernels_pallas.gdn import api, pallas_gpu, reference

DK, DV = 16, 32
INTERPRET = common.default_interpret()  # the interpreter off GPU; compiled through Triton on a GPU
BACKEND = common.backend_of(INTERPRET)
ref_chunk = jax.jit(reference.chunk_gated_delta_rule)
ref_rows = jax.jit(reference.recurrent_gated_delta_rule)


def _inputs(seed, b, t, hk, h, *, initial_state, lens=None):
    args = testing.gdn_inputs(np.random.default_rng(seed), b, t, hk, h, DK, DV, initial_state=initial_state)
    return args if lens is None else testing.gdn_pad_rows(args, lens)


@functools.cache
def _kernel(kind, block_v=None, matvec_as=None):
    if kind == "chunk":
        fn, tiling = pallas_gpu.chunk_gated_delta_rule, pallas_gpu.ChunkTiling(block_v=block_v or DV)
    else:
        fn, tiling = pallas_gpu.recurrent_gated_delta_rule, pallas_gpu.RowsTiling(block_v=block_v or DV)
    return jax.jit(functools.partial(fn, tiling=tiling, interpret=INTERPRET, matvec_as=matvec_as))


def _assert_written(*xs):
    for x in xs:
        assert not np.isnan(np.asarray(x)).any(), "an output element was never written (NaN-poisoned)"


def test_interpreter_poisons_unwritten_outputs():
    """The premise of `_assert_written`: the interpreter NaN-fills output buffers (a property of
    the interpreter, so this one runs interpreted on every backend)."""

    def half(x_ref, o_ref):
        o_ref[0] = x_ref[0]

    out = pl.pallas_call(half, out_shape=jax.ShapeDtypeStruct((2, 8), jnp.float32), interpret=True)(jnp.ones((2, 8)))
    assert np.isnan(np.asarray(out[1])).all() and (np.asarray(out[0]) == 1).all()


@pytest.mark.parametrize("t", [64, 100, 130])
@pytest.mark.parametrize("initial_state", [True, False])
def test_references_agree(t, initial_state):
    args = _inputs(t, 2, t, 1, 2, initial_state=initial_state)
    o_c, s_c = ref_chunk(*args)
    o_r, states = ref_rows(*args)
    assert testing.rel_err(o_c, o_r) <= 1e-5
    assert testing.rel_err(s_c, states[:, -1]) <= 1e-5


@pytest.mark.parametrize("t", [64, 100, 130])
@pytest.mark.parametrize("hk", [1, 2])
@pytest.mark.parametrize("initial_state", [True, False])
def test_chunk_bit_identical(t, hk, initial_state):
    assert api.CHUNK_CONTRACT == "bit-identical"
    args = _inputs(t + hk, 2, t, hk, 2, initial_state=initial_state, lens=[t, t - 37])
    _assert_chunk_matches_reference(args, DV)


@pytest.mark.parametrize("t", [64, 70])
def test_chunk_bit_identical_at_tiny_prefill_shape(t):
    """One sequence, GVA 2, dk 8, dv 16: the engine's prefill chunk on the tiny preset. On jax
    0.11.2's XLA CPU a state update written as swapaxes + @ rounds differently from the kernel's
    x.T @ y at this shape (B = 1, dv = 16), and only here among the shapes of this file, so this
    case holds the reference to the in-place contraction (see the reference's NOTE)."""
    args = testing.gdn_inputs(np.random.default_rng(t), 1, t, 2, 4, 8, 16, initial_state=True)
    if reason := api.gdn_chunk_supported(*args, backend=BACKEND, tiling=pallas_gpu.ChunkTiling(block_v=16)):
        pytest.skip(reason)
    _assert_chunk_matches_reference(args, 16)


def _assert_meets_contract(outs, refs, args, kind):
    """Each kernel output against the reference's (`testing.assert_contract`)."""

    for x, x_ref, x64 in zip(outs, refs, testing.gdn_oracles(args, chunk=kind == "chunk")):
        testing.assert_contract(x, x_ref, x64, interpret=INTERPRET)


def _assert_chunk_matches_reference(args, dv):
    o, final = _kernel("chunk", block_v=dv)(*args)
    _assert_written(o, final)
    _assert_meets_contract((o, final), ref_chunk(*args), args, "chunk")


@pytest.mark.parametrize("t", [1, 3, 4, 8])
@pytest.mark.parametrize("hk", [1, 2])
@pytest.mark.parametrize("initial_state", [True, False])
def test_rows_bit_identical(t, hk, initial_state):
    assert api.ROWS_CONTRACT == "bit-identical"
    lens = [t, max(t - 2, 1), 0]  # full, ragged, all padding
    args = _inputs(10 * t + hk, 3, t, hk, 2, initial_state=initial_state, lens=lens)
    o, states = _kernel("rows")(*args)
    _assert_written(o, states)
    _assert_meets_contract((o, states), ref_rows(*args), args, "rows")
    # Identity rows leave the state exactly as the last valid row left it.
    np.testing.assert_array_equal(np.asarray(states)[2], np.broadcast_to(args[5][2], states.shape[1:]))


@pytest.mark.parametrize("kind,t", [("rows", 4), ("chunk", 100)])
@pytest.mark.parametrize("variant", ["triton_body", "narrow_tiles"])
def test_bounded_variants_within_allowance(kind, t, variant):
    """What cannot be byte-equal on CPU (the GPU matvec form, value tiles narrower than Eigen's
    wide-matmul path) stays within `common.contract_bound` of the float64 oracle."""
    args = _inputs(7, 2, t, 1, 2, initial_state=True)
    kernel = _kernel(kind, matvec_as="reduce") if variant == "triton_body" else _kernel(kind, block_v=DV // 2)
    out, state = kernel(*args)
    _assert_written(out, state)
    out_ref, state_ref = (ref_chunk if kind == "chunk" else ref_rows)(*args)
    o64, states64 = testing.gdn_oracle(*args)
    s64 = states64[:, -1] if kind == "chunk" else states64
    for x, x_ref, x64 in ((out, out_ref, o64), (state, state_ref, s64)):
        assert testing.rel_err(x, x64) <= common.contract_bound(testing.rel_err(x_ref, x64), jnp.float32)


# ---------------------------------------------------------------- refusals


def _shapes(b=2, t=4, hk=16, h=32, dk=128, dv=128, dtype=jnp.float32):
    return testing.gdn_abstract_args(b, t, hk, h, dk, dv, dtype)


def test_supported_at_model_shapes():
    for h in (32, 64):
        for backend in common.BACKENDS:
            assert api.gdn_rows_supported(*_shapes(h=h), backend=backend) is None
            assert api.gdn_chunk_supported(*_shapes(t=130, h=h), backend=backend) is None


@pytest.mark.parametrize(
    "kernel,kw,backend,needle",
    [
        ("rows", dict(t=9), "interpret", "at most 8 rows"),
        ("rows", dict(dk=96), "gpu", "dk=96"),
        ("chunk", dict(dv=48), "gpu", "block_v=48"),
        ("chunk", dict(dk=8, dv=8), "gpu", ">= 16"),
        ("chunk", dict(h=24), "interpret", "not a multiple of key heads"),
        ("rows", dict(dtype=jnp.bfloat16), "interpret", "float32"),
        ("chunk", {}, "tpu", "no Pallas kernel for backend 'tpu'"),
    ],
)
def test_refusals_carry_reasons(kernel, kw, backend, needle):
    check = api.gdn_rows_supported if kernel == "rows" else api.gdn_chunk_supported
    reason = check(*_shapes(**kw), backend=backend)
    assert reason is not None and needle in reason, reason


def test_refused_kernel_raises_and_reference_still_runs():
    args = _inputs(0, 1, 9, 1, 2, initial_state=True)
    with pytest.raises(KernelRefused, match="at most 8 rows"):
        api.recurrent_gated_delta_rule(*args, interpret=INTERPRET)
    o, _ = api.recurrent_gated_delta_rule(*args, implementation="reference")
    _assert_written(o)
    with pytest.raises(ValueError, match="implementation"):
        api.chunk_gated_delta_rule(*args, implementation="triton")
