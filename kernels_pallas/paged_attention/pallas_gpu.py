"""Pallas (Triton-lowerable) causal GQA attention over the paged KV cache, for decode rows, verify
rows and prefill chunks alike.

Owns: the `pallas_call`, its row layout and tiling (`AttentionTiling`), its tile loop and its
body's two backend forms (`Form`).
Callers go through `kernels_pallas.paged_attention.api`, which checks shapes first.

Layout (B batch, T rows, H query heads, KV kv heads, rep = H // KV, D head dim, bs block size):
- The query rows of one kv head are flattened to M = T * rep rows (row m = t * rep + r is head
  kv * rep + r of row t) and padded to a multiple of `block_rows`; grid = (B, KV, Mp // block_rows).
- A program walks its sequence's block table in tiles of `pages` blocks (pages * bs keys), from
  key 0 up to the largest position among its rows, with an online softmax in float32. The loop
  body is `reference.paged_attention`'s, op for op.
- The block table row is an ordinary input read inside the kernel (Triton has no scalar prefetch);
  the pools are whole-array inputs gathered by block id and kv head inside the kernel.

NOTE: the pools' BlockSpec is `memory_space=pl.ANY` (no block): Triton gets a plain pointer either
way, and the interpreter then reads the pools in place instead of copying a pool-sized block at
every grid step.

Invariants:
- A row reads keys 0..position of its own sequence only. Tiles past the one holding the block's
  largest position are never loaded; within that tile, keys past it are masked out of the scores
  and zeroed out of the values, so stale or non-finite KV there (or in table entries past the
  sequence's blocks) never reaches the output.
- Padding rows (position < 0) output exact zeros. Every output element is written exactly once.
- Dtypes follow the reference: K/V are cast to q's dtype before each dot; the QK dot accumulates in
  float32, its scores are rounded to q's dtype and scaled in it (HF's eager path); softmax and the
  PV accumulation are float32, with the probabilities cast to q's dtype before the PV dot.
- The body is the same code on both backends except two ops, picked by `form` (`default_form`):
  "reference" under the interpreter runs the reference's own (the tile sum as
  `reductions.pairwise_sum`'s tree of elementwise adds, dot operands widened by `reference.widen`),
  which with the interpreter's tiling (`AttentionTiling.get_default`) makes the kernel byte-equal to the reference;
  "triton" when compiled runs tl.sum (Triton cannot slice a tile) and dots in q's dtype (tensor
  cores). Tests run both forms on CPU.
- The batch-invariant configuration (`AttentionTiling.get_invariant`, `invariant_form`): row blocks of
  `INVARIANT_BLOCK_ROWS` whatever the query count; under the interpreter the "invariant" form, the
  "reference" form with the products as `invariant_einsum`s and the running max `reductions.fenced` (the
  reference's invariant walk, op for op); compiled, the "triton" form in those fixed blocks.

Precondition: positions < block_tables.shape[1] * bs (a row's keys fit its table).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas.invariant import invariant_einsum
from kernels_pallas.paged_attention import reference
from kernels_pallas.reductions import fenced, pairwise_sum

Form = Literal["reference", "triton", "invariant"]  # the body's form (see the module docstring)
FORMS: tuple[Form, ...] = ("reference", "triton", "invariant")
#: Query rows per program in the batch-invariant configuration (`AttentionTiling.get_invariant`): the
#: least row block Triton's dots take, whatever the query count.
INVARIANT_BLOCK_ROWS = 16


@dataclasses.dataclass(frozen=True)
class AttentionTiling:
    """The kernel's tiling: `block_rows` query rows per program (of a kv head's T * H / KV), `pages`
    blocks per key tile (pages * bs keys per loop step); Triton's `num_warps` and `num_stages`
    (the interpreter ignores them)."""

    block_rows: int
    pages: int
    num_warps: int = 4
    num_stages: int = 2

    @classmethod
    def get_default(cls, t: int, h: int, kvh: int, bs: int, *, interpret: bool) -> AttentionTiling:
        """Key tiles of `reference.tile_pages(bs)` blocks. Rows: under the interpreter all T * H / KV
        rows of a kv head (at least `reference.MIN_ROWS`), the reference's row matrix; on a GPU a
        power of two in [16, 64] covering them when it can."""
        rows = t * (h // kvh)
        if interpret:
            return cls(block_rows=max(rows, reference.MIN_ROWS), pages=reference.tile_pages(bs))
        return cls(block_rows=min(64, max(16, 1 << (rows - 1).bit_length())), pages=reference.tile_pages(bs))

    @classmethod
    def get_invariant(cls, bs: int) -> AttentionTiling:
        """The batch-invariant configuration's tiling, on both backends: `INVARIANT_BLOCK_ROWS` rows per
        program and key tiles of `reference.tile_pages(bs)` blocks, whatever the query count (no block that
        grows with the rows run together)."""
        return cls(block_rows=INVARIANT_BLOCK_ROWS, pages=reference.tile_pages(bs))


def default_form(interpret: bool) -> Form:
    """The body's form: "reference" under the interpreter (byte-equal to the reference), "triton"
    when compiled."""
    return "reference" if interpret else "triton"


def invariant_form(interpret: bool) -> Form:
    """The body's form in the batch-invariant configuration: "invariant" under the interpreter (byte-equal
    to the reference's invariant walk), "triton" when compiled (a fixed [block_rows, tile] program per row
    block: its tl.dot and tl.sum orders are the block's, not the query count's)."""
    return "invariant" if interpret else "triton"


def _scores(q, k, invariant: bool):
    """q [bm, D] . k [tile, D] -> [bm, tile] float32: a 2-D dot, or in the "invariant" form `invariant_einsum`
    (the reference's invariant walk's tree per output element, whatever the block's other rows)."""
    if invariant:
        return invariant_einsum("md,sd->ms", q, k, preferred_element_type=jnp.float32)
    return lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _weighted(p, v, invariant: bool):
    """p [bm, tile] @ v [tile, D] -> [bm, D] float32, as `_scores`."""
    if invariant:
        return invariant_einsum("ms,sd->md", p, v, preferred_element_type=jnp.float32)
    return jnp.dot(p, v, preferred_element_type=jnp.float32)


def _attention_kernel(q_ref, pos_ref, bt_ref, k_ref, v_ref, o_ref, *, scale: float, pages: int, form: Form):
    """q_ref [bm, D]; pos_ref [bm] int32; bt_ref [MBp] int32; k_ref, v_ref [NB, bs, KV, D] (whole
    pools; this program's kv head is program_id(1)); o_ref [bm, D]."""
    bs, d = k_ref.shape[1], k_ref.shape[3]
    g = pl.program_id(1)
    tile = pages * bs
    exact = form != "triton"
    invariant = form == "invariant"
    q = q_ref[...]  # [bm, D]
    dtype = q.dtype
    operand = functools.partial(reference.widen, dtype=dtype) if exact else (lambda x: x.astype(dtype))
    qd = operand(q)
    pos = pos_ref[...]  # [bm]
    last = jnp.max(pos)  # the furthest key any row of this block reads
    n_tiles = jnp.where(last >= 0, last // tile + 1, 0)

    def body(j, carry):
        acc, m, denom = carry  # [bm, D] [bm] [bm] f32: the running PV sum, max and probability sum
        ids = bt_ref[pl.ds(j * pages, pages)]  # [pages]
        k = operand(k_ref[ids, :, g].reshape(tile, d))  # [tile, D]
        v = operand(v_ref[ids, :, g].reshape(tile, d))
        kpos = j * tile + lax.broadcasted_iota(jnp.int32, (tile,), 0)  # [tile]
        s = _scores(qd, k, invariant)  # [bm, tile]
        s = (s.astype(dtype) * jnp.asarray(scale, dtype)).astype(jnp.float32)  # as the reference
        s = jnp.where(kpos[None, :] <= pos[:, None], s, -jnp.inf)  # [bm, tile]
        m_new = fenced(jnp.maximum(m, jnp.max(s, axis=1)), invariant)
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with no key yet: p = alpha = 0
        p = jnp.exp(s - m_safe[:, None])
        alpha = jnp.exp(m - m_safe)
        v = jnp.where((kpos <= last)[:, None], v, jnp.zeros_like(v))  # 0 * stale NaN would poison
        pv = _weighted(operand(p), v, invariant)  # [bm, D]
        p_sum = pairwise_sum(p) if exact else jnp.sum(p, axis=1)  # [bm]
        return alpha[:, None] * acc + pv, m_new, alpha * denom + p_sum

    init = (
        jnp.zeros(q.shape, jnp.float32),
        jnp.full(pos.shape, -jnp.inf, jnp.float32),
        jnp.zeros(pos.shape, jnp.float32),
    )
    acc, _, denom = lax.fori_loop(0, n_tiles, body, init)
    out = jnp.where((pos >= 0)[:, None], acc / denom[:, None], 0.0)  # padding rows: denom = 0 -> zeros
    o_ref[...] = out.astype(o_ref.dtype)


def paged_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    positions,
    scale: float,
    *,
    tiling: AttentionTiling,
    interpret: bool,
    form: Form | None = None,
) -> jax.Array:
    """q [B, T, H, D]; k_cache, v_cache [NB, bs, KV, D]; block_tables [B, MB] int32;
    positions [B, T] int32 (< 0 = padding). Returns [B, T, H, D] in q's dtype. form: the
    body's form (see the module docstring), None = `default_form(interpret)`.

    NOTE: the row flattening is a transpose copy of q and of the output (T * H * D each), and the
    block table is padded to a multiple of `pages` with block 0 (only ever read past every row's
    last key, where it is masked).
    """
    form = form or default_form(interpret)
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}; got {form!r}")
    if form == "invariant" and not interpret:
        raise ValueError("the 'invariant' form runs under the interpreter (Triton cannot slice a tile)")
    block_rows, pages = tiling.block_rows, tiling.pages
    b, t, h, d = q.shape
    kvh = k_cache.shape[2]
    rep = h // kvh
    m = t * rep
    mp = -(-m // block_rows) * block_rows
    rows = q.reshape(b, t, kvh, rep, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, m, d)
    rows = jnp.pad(rows, [(0, 0), (0, 0), (0, mp - m), (0, 0)])  # [B, KV, Mp, D]
    row_pos = jnp.pad(jnp.repeat(positions.astype(jnp.int32), rep, axis=1), [(0, 0), (0, mp - m)], constant_values=-1)
    tables = jnp.pad(block_tables.astype(jnp.int32), [(0, 0), (0, (-block_tables.shape[1]) % pages)])
    row_spec = pl.BlockSpec((None, None, block_rows, d), lambda i, g, j: (i, g, j, 0))
    pool_spec = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        functools.partial(_attention_kernel, scale=scale, pages=pages, form=form),
        grid=(b, kvh, mp // block_rows),
        in_specs=[
            row_spec,
            pl.BlockSpec((None, block_rows), lambda i, g, j: (i, j)),
            pl.BlockSpec((None, tables.shape[1]), lambda i, g, j: (i, 0)),
            pool_spec,
            pool_spec,
        ],
        out_specs=row_spec,
        out_shape=jax.ShapeDtypeStruct(rows.shape, q.dtype),
        interpret=interpret,
        compiler_params=(
            None if interpret else pltriton.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages)
        ),
        name=f"paged_attention_bm{block_rows}_p{pages}",
    )(rows, row_pos, tables, k_cache, v_cache)
    out = out[:, :, :m].reshape(b, kvh, t, rep, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, h, d)
