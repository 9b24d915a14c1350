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

CHUNK = 64
UNROLL_ROWS = 8  # recurrences of at most this many rows are unrolled


def _expand_heads(x, heads):
    """[B, T, Hk, d] -> [B, T, H, d]: value head h reads key head h // (H // Hk)."""
    return jnp.repeat(x, heads // x.shape[2], axis=2)


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state):
    """Token-by-token recurrence.

    Returns (o [B, T, H, dv] f32, states [B, T, H, dk, dv] f32): states[:, t] is the state after
    row t (so states[:, -1] is the final state).
    """
    heads = v.shape[2]
    q = _expand_heads(q, heads)
    k = _expand_heads(k, heads)

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B,H,dk] [B,H,dk] [B,H,dv] [B,H] [B,H]
        s = s * jnp.exp(g_t)[..., None, None]
        kv_mem = jnp.einsum("bhkv,bhk->bhv", s, k_t)
        delta = (v_t - kv_mem) * b_t[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        o_t = jnp.einsum("bhkv,bhk->bhv", s, q_t)
        return s, (o_t, s)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    # NOTE: decode and verify rows (T <= UNROLL_ROWS) are unrolled: a loop of a few iterations
    # costs more in loop control than its body on XLA CPU; the arithmetic is the same.
    _, (o, states) = jax.lax.scan(step, initial_state, xs, unroll=q.shape[1] <= UNROLL_ROWS)
    return jnp.moveaxis(o, 0, 1), jnp.moveaxis(states, 0, 1)


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state, chunk_size: int = CHUNK):
    """Chunked (WY) form, as HF's torch_chunk_gated_delta_rule.

    Returns (o [B, T, H, dv] f32, final_state [B, H, dk, dv] f32). T need not be a multiple of
    chunk_size: rows are padded with identity rows (k = v = beta = g = 0).
    """
    b, t, heads, dv = v.shape
    dk = q.shape[-1]
    q = _expand_heads(q, heads)
    k = _expand_heads(k, heads)
    pad = (-t) % chunk_size
    if pad:
        padt = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        q, k, v, g, beta = map(padt, (q, k, v, g, beta))
    n = (t + pad) // chunk_size
    # [B, H, N, C, d]
    to_chunks = lambda x: jnp.moveaxis(x, 2, 1).reshape(b, heads, n, chunk_size, *x.shape[3:])
    q, k, v, g, beta = map(to_chunks, (q, k, v, g, beta))
    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    gam = jnp.cumsum(g, axis=-1)  # [B,H,N,C]
    tri_incl = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    tri_strict = jnp.tril(jnp.ones((chunk_size, chunk_size), bool), -1)
    decay = jnp.where(tri_incl, jnp.exp(jnp.where(tri_incl, gam[..., :, None] - gam[..., None, :], 0.0)), 0.0)
    a = jnp.where(tri_strict, jnp.einsum("...ik,...jk->...ij", k_beta, k) * decay, 0.0)
    eye = jnp.eye(chunk_size, dtype=jnp.float32)
    # Tm = (I + A)^{-1}; I + A is unit lower triangular.
    tm = jax.scipy.linalg.solve_triangular(eye + a, jnp.broadcast_to(eye, a.shape), lower=True, unit_diagonal=True)
    u = tm @ v_beta  # [B,H,N,C,dv]
    w = tm @ (k_beta * jnp.exp(gam)[..., None])  # [B,H,N,C,dk]
    qk = jnp.where(tri_incl, jnp.einsum("...ik,...jk->...ij", q, k) * decay, 0.0)
    g_last = gam[..., -1]  # [B,H,N]

    def step(s, xs):
        q_c, k_c, u_c, w_c, qk_c, gam_c, gl_c = xs
        v_new = u_c - w_c @ s
        o_c = (q_c * jnp.exp(gam_c)[..., None]) @ s + qk_c @ v_new
        # NOTE: the chunk rows are contracted in place ("ck,cv->kv", as the kernel's x.T @ y
        # dot_general): a swapaxes then @ rounds differently from the kernel on jax 0.11.2's XLA
        # CPU for one sequence with dv = 16 (tests/test_kernels_gdn.py, tiny prefill shape).
        s = s * jnp.exp(gl_c)[..., None, None] + jnp.einsum(
            "...ck,...cv->...kv", k_c * jnp.exp(gl_c[..., None] - gam_c)[..., None], v_new
        )
        return s, o_c

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, u, w, qk, gam, g_last))
    final, o = jax.lax.scan(step, initial_state, xs)  # o [N,B,H,C,dv]
    o = jnp.moveaxis(o, 0, 2).reshape(b, heads, n * chunk_size, dv)
    o = jnp.moveaxis(o, 1, 2)[:, :t]
    del dk
    return o, final
