"""Partial NeoX-style rotary embedding (full-attention layers and the MTP layer).

Invariant: cos/sin are computed in float32 and cast to the activation dtype before use (HF), and
only the first `2 * ceil(rotary_dim / 2)` channels of each head rotate.
"""

from __future__ import annotations

import jax.numpy as jnp


def apply_rope(x, positions, rotary_dim: int, theta: float):
    """x: [B, T, heads, D]; positions: [B, T] int32. Returns x with its first 2 * ceil(rotary_dim / 2)
    channels rotated (HF: one frequency per even index below rotary_dim, two channels each, so an
    odd rotary_dim rotates one channel more)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    half = inv_freq.shape[0]
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, half]
    cos = jnp.concatenate([jnp.cos(ang), jnp.cos(ang)], -1).astype(x.dtype)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(ang), jnp.sin(ang)], -1).astype(x.dtype)[:, :, None, :]
    xr, xp = x[..., : 2 * half], x[..., 2 * half :]
    rot = jnp.concatenate([-xr[..., half:], xr[..., :half]], -1)
    return jnp.concatenate([xr * cos + rot * sin, xp], -1)
