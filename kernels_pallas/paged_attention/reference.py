"""Reference (jnp) paged attention and the paged KV write.

Owns: how a row's keys and values land in the block pool, and how a row attends to the cache.

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
- Scores and softmax in float32 (HF's eager path); the probabilities are cast to the value dtype
  before the PV product, as HF does.
"""

from __future__ import annotations

import jax.numpy as jnp


def write_kv(k_cache, v_cache, k, v, block_tables, positions, null_block: int):
    """Scatter rows' K/V into the pool.

    k, v: [B, T, KV, D]; positions [B, T] int32 (< 0 = padding). Returns the new caches.
    """
    bs = k_cache.shape[1]
    valid = positions >= 0
    pos = jnp.where(valid, positions, 0)
    blk = jnp.take_along_axis(block_tables, pos // bs, axis=1)
    blk = jnp.where(valid, blk, null_block)
    off = jnp.where(valid, pos % bs, 0)
    k_cache = k_cache.at[blk, off].set(k.astype(k_cache.dtype))
    v_cache = v_cache.at[blk, off].set(v.astype(v_cache.dtype))
    return k_cache, v_cache


def paged_attention(q, k_cache, v_cache, block_tables, positions, scale: float):
    """Causal GQA attention of query rows over their sequences' paged KV.

    q: [B, T, H, D]; positions [B, T] (< 0 = padding). Returns [B, T, H, D] in q's dtype.
    """
    b, t, h, d = q.shape
    nb, bs, kvh, _ = k_cache.shape
    mb = block_tables.shape[1]
    keys = k_cache[block_tables].reshape(b, mb * bs, kvh, d).astype(q.dtype)  # [B, S, KV, D]
    vals = v_cache[block_tables].reshape(b, mb * bs, kvh, d).astype(q.dtype)
    span = jnp.arange(mb * bs)
    live = span[None, :] <= jnp.max(positions, axis=1)[:, None]  # [B, S]
    keys = jnp.where(live[:, :, None, None], keys, 0)
    vals = jnp.where(live[:, :, None, None], vals, 0)
    rep = h // kvh
    qg = q.reshape(b, t, kvh, rep, d)
    # NOTE: the scores are rounded to q's dtype and scaled in it before the f32 softmax, as HF's
    # eager attention does (a no-op in float32).
    scores = jnp.einsum("btgrd,bsgd->btgrs", qg, keys, preferred_element_type=jnp.float32)
    scores = (scores.astype(q.dtype) * jnp.asarray(scale, q.dtype)).astype(jnp.float32)
    mask = span[None, None, :] <= positions[:, :, None]  # [B, T, S]
    scores = jnp.where(mask[:, :, None, None, :], scores, -jnp.inf)
    valid = positions >= 0
    scores = jnp.where(valid[:, :, None, None, None], scores, 0.0)
    probs = _softmax(scores).astype(q.dtype)
    out = jnp.einsum("btgrs,bsgd->btgrd", probs, vals, preferred_element_type=jnp.float32)
    out = jnp.where(valid[:, :, None, None, None], out, 0.0)
    return out.reshape(b, t, h, d).astype(q.dtype)


def _softmax(x):
    """Softmax over the last axis in the order the kernels reproduce (max, exp, sum, divide)."""
    m = jnp.max(x, axis=-1, keepdims=True)
    e = jnp.exp(x - m)
    return e / jnp.sum(e, axis=-1, keepdims=True)
