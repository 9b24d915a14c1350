"""RMSNorms of the Qwen3-Next family, with HF's exact dtype paths.

Invariants: the zero-centred norm multiplies by (1 + w) in float32 and casts once at the end; the
gated norm (GDN output) is not zero-centred and rounds to the model dtype twice (after the
normalisation and after the weight product), as transformers does. The mean of squares is a
`pairwise_sum`, so a row's norm has the same bytes in any batch and any program (XLA CPU's
`jnp.mean` order depends on the shape and on how the norm's producer is fused, which differs
between the two forwards' programs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.reductions import pairwise_sum


def _rms(x32, eps: float):
    """rsqrt(mean(x^2) + eps) over the last axis, keepdims; float32 in and out."""
    return jax.lax.rsqrt(pairwise_sum(x32 * x32)[..., None] / x32.shape[-1] + eps)


def rms_norm(x, w, eps: float):
    """Zero-centred RMSNorm over the last axis: x * rsqrt(mean(x^2) + eps) * (1 + w)."""
    x32 = x.astype(jnp.float32)
    y = x32 * _rms(x32, eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def gated_rms_norm(x, z, w, eps: float):
    """RMSNormGated: (w * norm(x).astype(dt)) * silu(z.f32), cast to dt. x, z: [..., dv]; w: [dv]."""
    dt = x.dtype
    x32 = x.astype(jnp.float32)
    n = x32 * _rms(x32, eps)
    t = w.astype(dt) * n.astype(dt)
    return (t.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(dt)
