"""Pallas (Triton-lowerable) Gated DeltaNet kernels: chunked prefill and per-row decode/verify.

Owns: the two `pallas_call`s, their block layout and their tiling (`RowsTiling`, `ChunkTiling`,
each with its `get_default`). Callers go through `kernels_pallas.gdn.api`, which checks shapes
first; these functions assume supported shapes.

Layout (B batch, T rows, Hk key heads, H value heads, r = H // Hk, dk key dim, dv value dim):
- grid = (B, H, dv // block_v); one program owns one value head's state columns
  [dk, block_v] for the whole call, so the row/chunk recurrence runs inside the program.
- GVA: value head h reads key head h // r through the q/k index maps; q and k are never repeated.

Invariants:
- Every op of a kernel body is the reference's op, in the reference's order, on the block that the
  reference's batched op would give this (b, h) — so under the interpreter, with block_v = dv,
  the kernels are byte-equal to `kernels_pallas.gdn.reference` (the matvec form aside, see
  `kernels_pallas.common.matvec_form`).
- The state is float32 throughout; every output element is written exactly once.

NOTE: state columns are independent in the delta rule (column j of S only ever meets column j of
v), so `block_v` tiles dv across programs; each tile recomputes the chunk's dk-side terms (A, Tm,
w, qk). A smaller block_v trades that recompute for occupancy and register pressure on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas.common import MatvecForm, matvec, matvec_form
from kernels_pallas.gdn.reference import CHUNK


@dataclasses.dataclass(frozen=True)
class RowsTiling:
    """The rows kernel's tiling: `block_v` value columns per program (divides dv); Triton's
    `num_warps` and `num_stages` (the interpreter ignores them)."""

    block_v: int
    num_warps: int = 4
    num_stages: int = 1

    @classmethod
    def get_default(cls, dv: int, *, interpret: bool) -> RowsTiling:
        """Interpreter: all of dv (byte-equal to the reference). GPU: 32 columns (a decode step has
        only B * H heads to spread over the SMs). Untuned: benchmarks/gpu_check.py times the defaults."""
        return cls(block_v=dv if interpret else min(dv, 32))


@dataclasses.dataclass(frozen=True)
class ChunkTiling:
    """The chunk kernel's tiling: `block_v` value columns per program (divides dv), `chunk` rows per
    WY chunk (the reference's `CHUNK`, which byte-equality needs); Triton's `num_warps` and
    `num_stages` (the interpreter ignores them)."""

    block_v: int
    chunk: int = CHUNK
    num_warps: int = 4
    num_stages: int = 1

    @classmethod
    def get_default(cls, dv: int, *, interpret: bool) -> ChunkTiling:
        """Interpreter: all of dv (byte-equal to the reference). GPU: 64 columns (each tile
        recomputes the chunk's dk-side terms). Untuned: benchmarks/gpu_check.py times the defaults."""
        return cls(block_v=dv if interpret else min(dv, 64))


def _compiler_params(tiling: RowsTiling | ChunkTiling, interpret: bool):
    """Triton's launch parameters, or None under the interpreter."""
    if interpret:
        return None
    return pltriton.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages)


def _rows_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, h0_ref, o_ref, s_ref, *, rows: int, form: MatvecForm):
    """One value head, state columns [dk, bv], `rows` rows unrolled (the reference scan's step).

    q_ref, k_ref [T, dk]; v_ref [T, bv]; g_ref, b_ref [T]; h0_ref [dk, bv];
    o_ref [T, bv]; s_ref [T, dk, bv] (the state after each row).
    form "invariant" (the batch-invariant configuration): each row starts from a fenced state and row, as the
    reference's invariant recurrence, so row t runs a decode's arithmetic from the state after row t - 1.
    """
    s = h0_ref[...]  # [dk, bv]
    for t in range(rows):
        q_t, k_t, v_t, g_t, b_t = q_ref[t], k_ref[t], v_ref[t], g_ref[t], b_ref[t]  # [dk] [dk] [bv] [] []
        if form == "invariant":
            s, (q_t, k_t, v_t, g_t, b_t) = lax.optimization_barrier((s, (q_t, k_t, v_t, g_t, b_t)))
        s = s * jnp.exp(g_t)
        kv_mem = matvec(s, k_t, form)  # [bv]
        delta = (v_t - kv_mem) * b_t
        s = s + k_t[:, None] * delta[None, :]
        o_ref[t] = matvec(s, q_t, form)
        s_ref[t] = s


def recurrent_gated_delta_rule(
    q, k, v, g, beta, h0, *, tiling: RowsTiling, interpret: bool, matvec_as: MatvecForm | None = None
) -> tuple[jax.Array, jax.Array]:
    """Per-row recurrence (decode / verify), every row's state out.

    q, k [B, T, Hk, dk] f32; v [B, T, H, dv] f32; g, beta [B, T, H] f32; h0 [B, H, dk, dv] f32.
    Returns (o [B, T, H, dv] f32, states [B, T, H, dk, dv] f32) as the reference does.
    matvec_as: None = `matvec_form(interpret)`; tests set "reduce" to run the Triton body on CPU;
    "invariant" (interpreter only) is the batch-invariant configuration's (`_rows_kernel`).
    """
    if matvec_as == "invariant" and not interpret:
        raise ValueError("the 'invariant' matvec form runs under the interpreter (Triton cannot slice a tile)")
    b, t, hk, dk = q.shape
    heads, dv = v.shape[2:]
    r = heads // hk
    block_v = tiling.block_v
    grid = (b, heads, dv // block_v)
    qk_spec = pl.BlockSpec((None, t, None, dk), lambda i, h, j: (i, 0, h // r, 0))
    v_spec = pl.BlockSpec((None, t, None, block_v), lambda i, h, j: (i, 0, h, j))
    gate_spec = pl.BlockSpec((None, t, None), lambda i, h, j: (i, 0, h))
    return pl.pallas_call(
        functools.partial(_rows_kernel, rows=t, form=matvec_as or matvec_form(interpret)),
        grid=grid,
        in_specs=[
            qk_spec,
            qk_spec,
            v_spec,
            gate_spec,
            gate_spec,
            pl.BlockSpec((None, None, dk, block_v), lambda i, h, j: (i, h, 0, j)),
        ],
        out_specs=[v_spec, pl.BlockSpec((None, t, None, dk, block_v), lambda i, h, j: (i, 0, h, 0, j))],
        out_shape=[
            jax.ShapeDtypeStruct((b, t, heads, dv), jnp.float32),
            jax.ShapeDtypeStruct((b, t, heads, dk, dv), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=_compiler_params(tiling, interpret),
        name=f"gdn_rows_t{t}_bv{block_v}",
    )(q, k, v, g, beta, h0)


def _select_row(x, i):
    """Row i of a 2-D value (exact: one element and zeros per column). NOTE: Triton cannot index
    a value dynamically, so rows are picked by mask."""
    rows = lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.sum(jnp.where(rows == i, x, 0.0), axis=0)


def _unit_lower_inverse(a, form: MatvecForm):
    """(I + a)^{-1} for strictly lower-triangular a [C, C], by forward substitution over rows:
    x_i = e_i - sum_j a_ij x_j (the order LAPACK's trsm takes on CPU)."""
    c = a.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    eye = (rows == lax.broadcasted_iota(jnp.int32, (c, c), 1)).astype(jnp.float32)

    def body(i, x):
        x_i = _select_row(eye, i) - matvec(x, _select_row(a, i), form)  # [C]
        return jnp.where(rows == i, x_i[None, :], x)

    return lax.fori_loop(1, c, body, eye)


def _chunk_kernel(
    q_ref, k_ref, v_ref, g_ref, b_ref, h0_ref, o_ref, hT_ref, *, chunks: int, chunk: int, form: MatvecForm
):
    """One value head, state columns [dk, bv], the whole (padded) sequence in `chunks` chunks of
    `chunk` rows.

    q_ref, k_ref [Tp, dk]; v_ref [Tp, bv]; g_ref, b_ref [Tp]; h0_ref [dk, bv];
    o_ref [Tp, bv]; hT_ref [dk, bv] (the state after the last chunk).
    """
    c = chunk
    rows = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    cols = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    tri_incl, tri_strict = rows >= cols, rows > cols
    last = lax.broadcasted_iota(jnp.int32, (c,), 0) == c - 1
    nt = (((1,), (1,)), ((), ()))  # x @ y.T
    tn = (((0,), (0,)), ((), ()))  # x.T @ y

    def step(n, s):
        sl = pl.ds(n * c, c)
        q, k, v, g, beta = q_ref[sl], k_ref[sl], v_ref[sl], g_ref[sl], b_ref[sl]  # [C, d] / [C]
        gam = jnp.cumsum(g)  # [C]
        decay = jnp.where(tri_incl, jnp.exp(jnp.where(tri_incl, gam[:, None] - gam[None, :], 0.0)), 0.0)
        kk = lax.dot_general(k, k, nt)  # [C, C]
        qk = lax.dot_general(q, k, nt)
        a = jnp.where(tri_strict, kk * beta[:, None] * decay, 0.0)
        tm = _unit_lower_inverse(a, form)
        e_gam = jnp.exp(gam)[:, None]
        u = tm @ (v * beta[:, None])  # [C, bv]
        w = tm @ (k * (beta[:, None] * e_gam))  # [C, dk]
        g_last = jnp.sum(jnp.where(last, gam, 0.0))  # gam[-1], exactly
        k_out = k * jnp.exp(g_last - gam)[:, None]
        v_new = u - w @ s
        o_ref[sl] = (q * e_gam) @ s + (qk * decay) @ v_new
        return s * jnp.exp(g_last) + lax.dot_general(k_out, v_new, tn)

    hT_ref[...] = lax.fori_loop(0, chunks, step, h0_ref[...])


def chunk_gated_delta_rule(
    q, k, v, g, beta, h0, *, tiling: ChunkTiling, interpret: bool, matvec_as: MatvecForm | None = None
) -> tuple[jax.Array, jax.Array]:
    """Chunked (WY) prefill, final state out.

    Same arguments and switches as `recurrent_gated_delta_rule`. Returns (o [B, T, H, dv] f32,
    final_state [B, H, dk, dv] f32) as the reference does (with chunk_size = tiling.chunk).

    NOTE: T is padded to a multiple of the chunk with identity rows (k = v = g = beta = 0), as in the
    reference; the padded copy of the inputs is the only traffic beyond the kernel's own, and only
    when T % chunk != 0.
    """
    b, t, hk, dk = q.shape
    heads, dv = v.shape[2:]
    r = heads // hk
    block_v, chunk = tiling.block_v, tiling.chunk
    pad = (-t) % chunk
    if pad:
        padt = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        q, k, v, g, beta = map(padt, (q, k, v, g, beta))
    tp = t + pad
    qk_spec = pl.BlockSpec((None, tp, None, dk), lambda i, h, j: (i, 0, h // r, 0))
    v_spec = pl.BlockSpec((None, tp, None, block_v), lambda i, h, j: (i, 0, h, j))
    gate_spec = pl.BlockSpec((None, tp, None), lambda i, h, j: (i, 0, h))
    state_spec = pl.BlockSpec((None, None, dk, block_v), lambda i, h, j: (i, h, 0, j))
    o, final = pl.pallas_call(
        functools.partial(_chunk_kernel, chunks=tp // chunk, chunk=chunk, form=matvec_as or matvec_form(interpret)),
        grid=(b, heads, dv // block_v),
        in_specs=[qk_spec, qk_spec, v_spec, gate_spec, gate_spec, state_spec],
        out_specs=[v_spec, state_spec],
        out_shape=[
            jax.ShapeDtypeStruct((b, tp, heads, dv), jnp.float32),
            jax.ShapeDtypeStruct((b, heads, dk, dv), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=_compiler_params(tiling, interpret),
        name=f"gdn_chunk_bv{block_v}",
    )(q, k, v, g, beta, h0)
    return o[:, :t], final
