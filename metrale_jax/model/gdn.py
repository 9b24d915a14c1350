"""Gated DeltaNet (linear attention) layer pieces, stateless: projections, short causal conv,
gates, q/k preparation and the gated output.

The stateful parts (which state a row starts from, where its state goes) belong to a state IO
(`metrale_jax.model.state_io`); this module is pure math.

Shapes: B batch, T rows, C = conv_dim = 2*nk*dk + nv*dv, Kc = conv kernel width.
Conv channel order: all q, then all k, then all v (Qwen3-Next's interleaved projection is
de-interleaved at load time, so params always hold the split Qwen3.5 form), group-major under a
tensor axis (`linear.split_groups`: each key-head group's q, k and v channels together).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from kernels_pallas.reductions import ordered_sum, pairwise_sum
from metrale_jax.config import ModelConfig
from metrale_jax.model.linear import linear, linear_parts, split_groups, tensor_groups
from metrale_jax.model.norms import gated_rms_norm
from metrale_jax.params import gdn_in_rows


def project(p, x, cfg: ModelConfig):
    """x [B, T, Hd] -> (mixed [B, T, C] pre-conv, z [B, T, nv, dv], b [B, T, nv], a [B, T, nv])."""
    chex.assert_shape(x, (None, None, cfg.hidden_size))
    b_, t = x.shape[:2]
    mixed, z, b, a = linear_parts(x, p["w_in"], gdn_in_rows(cfg))
    return mixed, z.reshape(b_, t, cfg.linear_num_value_heads, cfg.linear_value_head_dim), b, a


def causal_conv(mixed, window, w, lens):
    """Depthwise causal conv + SiLU continuing from a window of earlier inputs.

    mixed [B, T, C]; window [B, C, Kc] (the last Kc pre-conv columns before row 0, zeros at the
    start of a sequence); w [C, Kc]; lens [B] int32 (rows >= lens are padding).
    Returns (y [B, T, C] in mixed's dtype, windows [B, T, C, Kc] — the window after each row —,
    final [B, C, Kc] — the window after row lens-1, or the input window when lens == 0).
    """
    kc = w.shape[-1]
    b_, t, c = mixed.shape
    chex.assert_shape(window, (b_, c, kc))
    chex.assert_shape(lens, (b_,))
    ext = jnp.concatenate([jnp.swapaxes(window, 1, 2).astype(mixed.dtype), mixed], axis=1)  # [B, Kc+T, C]
    shifted = [ext[:, 1 + i : 1 + i + t] for i in range(kc)]  # Kc x [B, T, C]: tap i's input per row
    wd = w.astype(mixed.dtype)
    # NOTE: the taps are summed as [B, T, C] terms, index 0 first (`ordered_sum` over a leading
    # axis), not over the minor axis of the stacked [B, T, C, Kc] windows, which does not
    # vectorise on CPU; the same adds in the same order. Only the row form (decode, verify) reads
    # the windows, so the chunk form never builds them.
    y = jax.nn.silu(ordered_sum(jnp.stack([x * wd[:, i] for i, x in enumerate(shifted)]), axis=0))
    idx = lens[:, None] + jnp.arange(kc)[None, :]  # [B, Kc]: rows lens..lens+Kc-1 of ext
    final = jnp.swapaxes(jnp.take_along_axis(ext, idx[:, :, None], axis=1), 1, 2)
    return y, jnp.stack(shifted, axis=-1), final.astype(window.dtype)


def split_qkv(y, cfg: ModelConfig):
    """Post-conv [B, T, C] -> q, k [B, T, nk, dk] (L2-normalised, q scaled), v [B, T, nv, dv]; f32."""
    b_, t = y.shape[:2]
    nk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    y = y.astype(jnp.float32)
    q, k, v = split_groups(y, (cfg.key_dim, cfg.key_dim, cfg.value_dim), tensor_groups())
    q, k = q.reshape(b_, t, nk, dk), k.reshape(b_, t, nk, dk)
    v = v.reshape(b_, t, cfg.linear_num_value_heads, cfg.linear_value_head_dim)
    l2 = lambda x: x * jax.lax.rsqrt(pairwise_sum(x * x)[..., None] + 1e-6)
    return l2(q) * (dk**-0.5), l2(k), v


def gates(p, b, a):
    """beta = sigmoid(b) (activation dtype, then f32), g = -exp(A_log) * softplus(a + dt_bias) f32."""
    beta = jax.nn.sigmoid(b).astype(jnp.float32)
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + p["dt_bias"].astype(jnp.float32)
    )
    return beta, g


def mask_rows(k, beta, g, lens):
    """Make rows >= lens identity rows of the recurrence (k = beta = g = 0)."""
    valid = jnp.arange(k.shape[1])[None, :] < lens[:, None]  # [B, T]
    return (
        jnp.where(valid[..., None, None], k, 0.0),
        jnp.where(valid[..., None], beta, 0.0),
        jnp.where(valid[..., None], g, 0.0),
    )


def output(p, o, z, cfg: ModelConfig, dtype):
    """Core output o [B, T, nv, dv] f32 -> gated norm with z -> out_proj -> [B, T, Hd]."""
    chex.assert_shape(o, (None, None, cfg.linear_num_value_heads, cfg.linear_value_head_dim))
    chex.assert_equal_shape([o, z])
    b_, t = o.shape[:2]
    n = gated_rms_norm(o.astype(dtype), z, p["norm"], cfg.rms_norm_eps)
    return linear(n.reshape(b_, t, cfg.value_dim), p["out"])
