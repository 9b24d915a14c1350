"""Reference (jnp) Gated DeltaNet cores: the chunked form for prefill and the recurrent form that
yields every row's state (decode and speculative verify).

Owns: the delta-rule math of Qwen3-Next / Qwen3.5 linear attention, in float32.

Contract shared by both forms (B batch, T rows, H value heads, Hk key heads with H % Hk == 0,
value head h reads key head h // (H // Hk)):
- q, k: [B, T, Hk, dk] float32, already L2-normalised; q already scaled by dk**-0.5.
- v: [B, T, H, dv] float32; g: [B, T, H] float32 log-decay (<= 0); beta: [B, T, H] float32.
- initial_state: [B, H, dk, dv] float32.
- A row with k = 0, beta = 0 and g = 0 leaves the state unchanged (this is how callers pad).
Invariant: both forms compute S_t = e^{g_t} S_{t-1} + k_t (beta_t (v_t - (e^{g_t} S_{t-1})^T k_t))^T,
o_t = S_t^T q_t; they agree to f32 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.invariant import invariant_einsum

CHUNK = 32
UNROLL_ROWS = 8  # recurrences of at most this many rows are unrolled


def _expand_heads(x, heads):
    """[B, T, Hk, d] -> [B, T, H, d]: value head h reads key head h // (H // Hk)."""
    return jnp.repeat(x, heads // x.shape[2], axis=2)


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state, invariant: bool = False):
    """Token-by-token recurrence. `invariant` (the batch-invariant forward): the state's contractions are
    `invariant_einsum`s and each row starts from a fenced state, so row t of a verify runs the arithmetic of a
    decode from the state after row t-1, at any batch size.

    Returns (o [B, T, H, dv] f32, states [B, T, H, dk, dv] f32): states[:, t] is the state after
    row t (so states[:, -1] is the final state).
    """
    heads = v.shape[2]
    q = _expand_heads(q, heads)
    k = _expand_heads(k, heads)

    contract = invariant_einsum if invariant else jnp.einsum

    def step(s, xs):
        if invariant:
            # NOTE: unfenced, XLA fused row t-1's update into row t's products, and LLVM contracted the
            # multiply-adds of the fused expression differently from a decode's (which reads the state).
            s, xs = jax.lax.optimization_barrier((s, xs))
        q_t, k_t, v_t, g_t, b_t = xs  # [B,H,dk] [B,H,dk] [B,H,dv] [B,H] [B,H]
        s = s * jnp.exp(g_t)[..., None, None]
        kv_mem = contract("bhkv,bhk->bhv", s, k_t)
        delta = (v_t - kv_mem) * b_t[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        o_t = contract("bhkv,bhk->bhv", s, q_t)
        return s, (o_t, s)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    # NOTE: decode and verify rows (T <= UNROLL_ROWS) are unrolled: a loop of a few iterations
    # costs more in loop control than its body on XLA CPU; the arithmetic is the same.
    _, (o, states) = jax.lax.scan(step, initial_state, xs, unroll=q.shape[1] <= UNROLL_ROWS)
    return jnp.moveaxis(o, 0, 1), jnp.moveaxis(states, 0, 1)


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state, chunk_size: int = CHUNK):
    """Chunked (WY) form, as HF's torch_chunk_gated_delta_rule, one chunk per scan step.

    Returns (o [B, T, H, dv] f32, final_state [B, H, dk, dv] f32). T need not be a multiple of
    chunk_size: rows are padded with identity rows (k = v = beta = g = 0).

    NOTE: one scan step per chunk computes that chunk's WY terms, its output and the next state,
    as one kernel program does, so no [chunks, ...] intermediate goes through memory: the step's
    terms stay in cache. The chunk's rows are read in the callers' layout and transposed inside
    the step; the key-side products k k^T and q k^T are computed once per key head, for the r
    value heads that read it.
    """
    b, t, heads, dv = v.shape
    hk, dk = q.shape[2:]
    r, c = heads // hk, chunk_size
    pad = (-t) % c
    if pad:
        padt = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        q, k, v, g, beta = map(padt, (q, k, v, g, beta))
    n = (t + pad) // c
    # [N, B, C, Hk, (r,) ...]: value head h = kh * r + j reads key head kh.
    to_chunks = lambda x: jnp.moveaxis(x.reshape(b, n, c, hk, *x.shape[3:]), 1, 0)
    xs = (to_chunks(q), to_chunks(k), *(to_chunks(x.reshape(b, n * c, hk, r, *x.shape[3:])) for x in (v, g, beta)))
    tri_incl = jnp.tril(jnp.ones((c, c), bool))
    tri_strict = jnp.tril(jnp.ones((c, c), bool), -1)
    eye = jnp.eye(c, dtype=jnp.float32)

    def step(s, xs):  # s [B, Hk, r, dk, dv]
        q_c, k_c = (jnp.swapaxes(x, 1, 2) for x in xs[:2])  # [B, Hk, C, dk]
        v_c, g_c, b_c = (jnp.moveaxis(x, 1, 3) for x in xs[2:])  # [B, Hk, r, C, dv] / [B, Hk, r, C]
        # NOTE: the barrier materialises the cumulative log-decay: fused into its consumers, XLA
        # CPU recomputes the cumsum for every element of the [C, C] decay (no arithmetic changes).
        gam = jax.lax.optimization_barrier(jnp.cumsum(g_c, axis=-1))
        # NOTE: the inner where keeps exp finite above the diagonal (its gradient is 0, not NaN).
        decay = jnp.where(tri_incl, jnp.exp(jnp.where(tri_incl, gam[..., :, None] - gam[..., None, :], 0.0)), 0.0)
        kk = jnp.einsum("...ik,...jk->...ij", k_c, k_c)[:, :, None]  # [B, Hk, 1, C, C]
        qk = jnp.einsum("...ik,...jk->...ij", q_c, k_c)[:, :, None]
        a = jnp.where(tri_strict, kk * b_c[..., :, None] * decay, 0.0)
        # Tm = (I + A)^{-1}; I + A is unit lower triangular.
        tm = jax.scipy.linalg.solve_triangular(eye + a, jnp.broadcast_to(eye, a.shape), lower=True, unit_diagonal=True)
        e_gam = jnp.exp(gam)[..., None]
        k_c, q_c = k_c[:, :, None], q_c[:, :, None]
        u = tm @ (v_c * b_c[..., None])  # [B, Hk, r, C, dv]
        w = tm @ (k_c * (b_c[..., None] * e_gam))  # [B, Hk, r, C, dk]
        g_last = gam[..., -1]  # [B, Hk, r]
        v_new = u - w @ s
        o = (q_c * e_gam) @ s + (qk * decay) @ v_new
        # NOTE: the chunk rows are contracted in place ("ck,cv->kv", as the kernel's x.T @ y
        # dot_general): a swapaxes then @ rounds differently from the kernel on jax 0.11.2's XLA
        # CPU for one sequence with dv = 16 (tests/test_kernels_gdn.py, tiny prefill shape).
        k_out = k_c * jnp.exp(g_last[..., None] - gam)[..., None]
        s = s * jnp.exp(g_last)[..., None, None] + jnp.einsum("...ck,...cv->...kv", k_out, v_new)
        return s, jnp.moveaxis(o, 3, 1)  # [B, C, Hk, r, dv]

    def chunk(i, carry):
        s, o = carry
        s, o_i = step(s, tuple(jax.lax.dynamic_index_in_dim(x, i, keepdims=False) for x in xs))
        return s, jax.lax.dynamic_update_index_in_dim(o, o_i, i, 0)

    # NOTE: the chunk outputs go into a buffer that starts as the chunked v (same shape, every
    # chunk overwritten), not into a scan's stacked outputs: XLA starts those from a constant and
    # schedules each layer's copy of it at the program's start, so a prefill held one [N, B, C, H,
    # dv] f32 buffer per GDN layer from its start to the layer.
    final, o = jax.lax.fori_loop(
        0, n, chunk, (initial_state.reshape(b, hk, r, dk, dv), xs[2])
    )  # o [N, B, C, Hk, r, dv]
    o = jnp.moveaxis(o, 0, 1).reshape(b, n * c, heads, dv)[:, :t]
    return o, final.reshape(b, heads, dk, dv)
