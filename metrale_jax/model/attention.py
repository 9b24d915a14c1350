"""Gated full attention pieces, stateless: projections with the per-head interleaved gate, q/k
norms before partial RoPE, and the sigmoid-gated output projection.

Shapes: q [B, T, H, D], k/v [B, T, KV, D]; the attention itself (over a paged KV cache) is done by
the state IO.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from metrale_jax.config import ModelConfig
from metrale_jax.model.linear import linear, linear_parts
from metrale_jax.model.norms import rms_norm
from metrale_jax.model.rope import apply_rope
from metrale_jax.params import attn_in_rows


def project(p, x, positions, cfg: ModelConfig):
    """x [B, T, Hd], positions [B, T] -> (q, k, v, gate [B, T, H*D])."""
    chex.assert_shape(x, (None, None, cfg.hidden_size))
    chex.assert_shape(positions, x.shape[:2])
    b_, t = x.shape[:2]
    h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qg, k, v = linear_parts(x, p["w_in"], attn_in_rows(cfg))
    qg = qg.reshape(b_, t, h, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(b_, t, h * d)
    q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(k.reshape(b_, t, kvh, d), p["k_norm"], cfg.rms_norm_eps)
    v = v.reshape(b_, t, kvh, d)
    pos = jnp.maximum(positions, 0)
    q = apply_rope(q, pos, cfg.rotary_dim, cfg.rope_theta)
    k = apply_rope(k, pos, cfg.rotary_dim, cfg.rope_theta)
    return q, k, v, gate


def output(p, o, gate):
    """o [B, T, H, D] -> (o * sigmoid(gate)) @ Wo.T."""
    b_, t = o.shape[:2]
    return linear(o.reshape(b_, t, -1) * jax.nn.sigmoid(gate), p["wo"])
