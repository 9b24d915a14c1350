"""Reference (jnp) paged attention and the paged KV write.

Owns: how a row's keys and values land in the block pool, how a row attends to the cache, and the
shapes the kernel shares with it (the key tile: `TILE_KEYS`, `tile_pages`; the least row count of
a row matrix: `MIN_ROWS`), and the op the kernel borrows under the interpreter: `widen` (a dot
operand); the tile's probability sum is `reductions.pairwise_sum` on both sides.

Layout: k_cache / v_cache [NB, bs, KV, D] (one attention layer); block_tables [B, MB] int32 map a
sequence's logical block j to a physical block; token position p lives in block
block_tables[b, p // bs] at offset p % bs.

Invariants:
- A row with position < 0 is padding: its K/V go to `null_block` (a block nothing real reads) and
  its attention output is zero.
- A query at position p attends to cache positions 0..p of its own sequence, nothing else: KV
  that a rejected draft left beyond the sequence's length is never read until overwritten.
- Cache entries past a sequence's last queried position are never read, not even multiplied by a
  zero probability (they may hold anything, NaN included: stale rows, the null block).
- Scores and softmax in float32 (HF's eager path), the scores rounded to q's dtype and scaled in
  it first (a no-op in float32); the probabilities are cast to the value dtype before the PV
  product, as HF does. Both dots take q's-dtype operands and accumulate in float32.

NOTE: the reference is a tiled online softmax, not one softmax over the whole span, because it is
the twin of `pallas_gpu`'s loop: the same key tiles, the same row matrices and the same per-tile
ops in the same order and dtypes (scores, running max, rescale, exp, sums, PV accumulation, final
divide) are what make the kernel byte-equal to it under the CPU interpreter. Against a float64
oracle it is as accurate as the whole-span softmax (tests/test_kernels_paged_attention.py).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kernels_pallas.invariant import invariant_einsum
from kernels_pallas.reductions import fenced, pairwise_sum

TILE_KEYS = 64  # keys per tile: tile_pages(bs) blocks, read per loop step
MIN_ROWS = 2  # a row matrix has at least this many rows (padding rows at position -1)
UNROLL_TILES = 4  # block tables of at most this many key tiles are walked without a loop


def tile_pages(bs: int) -> int:
    """Blocks per key tile: TILE_KEYS keys, at least one block."""
    return max(1, TILE_KEYS // bs)


def widen(x, dtype):
    """x rounded to `dtype` (q's), then widened to float32: a dot operand.

    NOTE: a product of two bfloat16 or float16 values is exact in float32, so a float32 dot of
    widened operands is the q-dtype dot with float32 accumulation; and XLA CPU sums a float32 dot
    of given shapes alike in any program, while its bfloat16 dots (YNNPACK) sum in an order that
    depends on the surrounding program, so the kernel's score dot and this reference's would
    differ in the last bit. A no-op in float32.
    """
    return x.astype(dtype).astype(jnp.float32)


def write_kv(k_cache, v_cache, k, v, block_tables, positions, null_block: int, layer=None):
    """Scatter rows' K/V into the pool.

    k, v: [B, T, KV, D]; positions [B, T] int32 (< 0 = padding). Caches are one layer's
    [NB, bs, KV, D], or, with `layer` (int32 scalar, may be traced), the stacked [L, NB, bs, KV, D]
    written at that layer. Returns the new caches.
    NOTE: writing the stacked cache in place (rather than a layer slice that is then put back)
    keeps XLA from copying a layer's whole KV in and out at every step.
    """
    bs = k_cache.shape[-3]
    valid = positions >= 0
    pos = jnp.where(valid, positions, 0)
    blk = jnp.take_along_axis(block_tables, pos // bs, axis=1)
    blk = jnp.where(valid, blk, null_block)
    off = jnp.where(valid, pos % bs, 0)
    idx = (blk, off) if layer is None else (layer, blk, off)
    k_cache = k_cache.at[idx].set(k.astype(k_cache.dtype))
    v_cache = v_cache.at[idx].set(v.astype(v_cache.dtype))
    return k_cache, v_cache


def paged_attention(q, k_cache, v_cache, block_tables, positions, scale: float, layer=None, invariant: bool = False):
    """Causal GQA attention of query rows over their sequences' paged KV. `invariant` (the batch-invariant
    forward): the scores and PV are `invariant_einsum`s, the same bits for a row at any query count.

    q: [B, T, H, D]; positions [B, T] (< 0 = padding). Caches are one layer's [NB, bs, KV, D], or,
    with `layer` (int32 scalar, may be traced), the stacked [L, NB, bs, KV, D] read at that layer.
    Returns [B, T, H, D] in q's dtype.

    Each (sequence, kv head) is one matrix of M = T * rep query rows (row t * rep + r is query head
    kv * rep + r of row t), walked over key tiles of `tile_pages(bs)` blocks from key 0 to the tile
    holding the sequence's largest position, with an online softmax in float32.

    NOTE: M is padded to MIN_ROWS with padding rows: XLA CPU runs a one-row dot as a vector
    product, whose summation order depends on the batch around it (the kernel pads alike).
    """
    b, t, h, d = q.shape
    nb, bs, kvh, _ = k_cache.shape[-4:]
    rep = h // kvh
    m = t * rep
    mp = max(m, MIN_ROWS)
    pages = tile_pages(bs)
    tile = pages * bs
    f32 = jnp.float32
    contract = invariant_einsum if invariant else jnp.einsum
    rows = q.reshape(b, t, kvh, rep, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, m, d)
    rows = widen(jnp.pad(rows, [(0, 0), (0, 0), (0, mp - m), (0, 0)]), q.dtype)  # [B, KV, Mp, D]
    row_pos = jnp.pad(jnp.repeat(positions, rep, axis=1), [(0, 0), (0, mp - m)], constant_values=-1)  # [B, Mp]
    last = jnp.max(positions, axis=1)  # [B]: the furthest key any row of the sequence reads
    n_tiles = jnp.where(last >= 0, last // tile + 1, 0)  # [B]: tiles the sequence walks
    tables = jnp.pad(block_tables, [(0, 0), (0, (-block_tables.shape[1]) % pages)])  # [B, MBp]

    def load(cache, ids):  # ids [B, pages] -> [B, KV, tile, D], q's dtype widened
        # NOTE: one gather from the stacked cache; slicing the layer out first made XLA copy the
        # layer's whole KV at every step (the step's cost grew with the pool, not the work).
        blocks = cache[ids] if layer is None else cache[layer, ids]
        return widen(blocks.reshape(b, tile, kvh, d).transpose(0, 2, 1, 3), q.dtype)

    def body(j, carry):
        acc, mx, denom = carry  # [B, KV, Mp, D] [B, KV, Mp] [B, KV, Mp] f32: running PV sum, max, probability sum
        ids = lax.dynamic_slice_in_dim(tables, j * pages, pages, axis=1)  # [B, pages]
        k, v = load(k_cache, ids), load(v_cache, ids)  # [B, KV, tile, D]
        kpos = j * tile + jnp.arange(tile)  # [tile]
        s = contract("bgmd,bgsd->bgms", rows, k, preferred_element_type=f32)  # [B, KV, Mp, tile]
        s = (s.astype(q.dtype) * jnp.asarray(scale, q.dtype)).astype(f32)  # HF's rounding point
        s = jnp.where((kpos[None, :] <= row_pos[:, :, None])[:, None], s, -jnp.inf)
        m_new = fenced(jnp.maximum(mx, jnp.max(s, axis=-1)), invariant)  # [B, KV, Mp]
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with no key yet: p = alpha = 0
        p = jnp.exp(s - m_safe[..., None])  # [B, KV, Mp, tile]
        alpha = jnp.exp(mx - m_safe)  # [B, KV, Mp]
        live = kpos[None, :] <= last[:, None]  # [B, tile]
        v = jnp.where(live[:, None, :, None], v, jnp.zeros_like(v))  # 0 * stale NaN would poison
        pv = contract("bgms,bgsd->bgmd", widen(p, q.dtype), v, preferred_element_type=f32)  # [B, KV, Mp, D]
        acc_new, denom_new = alpha[..., None] * acc + pv, alpha * denom + pairwise_sum(p)
        # A sequence past its last tile keeps its carry (its kernel program has stopped walking).
        walking = (j < n_tiles)[:, None, None]  # [B, 1, 1]
        return (
            jnp.where(walking[..., None], acc_new, acc),
            jnp.where(walking, m_new, mx),
            jnp.where(walking, denom_new, denom),
        )

    init = (jnp.zeros((b, kvh, mp, d), f32), jnp.full((b, kvh, mp), -jnp.inf, f32), jnp.zeros((b, kvh, mp), f32))
    # NOTE: the running sums start after the rows exist: a loop state that starts as a constant
    # is copied out of it where XLA schedules it, the program's start, so a prefill held one
    # [B, KV, Mp, D] f32 buffer per attention layer from its start to the layer.
    init, _ = lax.optimization_barrier((init, rows))
    max_tiles = tables.shape[1] // pages
    if max_tiles <= UNROLL_TILES:
        # NOTE: a short table is walked tile by tile without a loop (every tile; a sequence past
        # its last one keeps its carry): XLA CPU loop control costs more than a tile's body.
        carry = init
        for j in range(max_tiles):
            carry = body(j, carry)
        acc, _, denom = carry
    else:
        acc, _, denom = lax.fori_loop(0, jnp.max(n_tiles), body, init)
    out = jnp.where((row_pos >= 0)[:, None, :, None], acc / denom[..., None], 0.0)  # padding rows: denom = 0 -> 0
    out = out[:, :, :m].reshape(b, kvh, t, rep, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, h, d).astype(q.dtype)
