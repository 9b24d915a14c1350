"""Reductions written so XLA CPU runs them as vectorised code, with the semantics of the plain ones.

Owns: `ordered_sum` (terms added left to right, index 0 first, in the input's dtype, whatever the
array's shape) and `first_argmax` (`jnp.argmax` over the last axis, int32).

NOTE: XLA CPU runs a reduction over a narrow axis (the GDN conv's 4 taps, the MoE's top-k
routing weights) as a library call, ~35 us each in a tiny verify step (a chain of elementwise
adds fuses into its neighbours), and argmax's paired (value, index) reduction as a scalar loop.
"""

from __future__ import annotations

import jax.numpy as jnp


def ordered_sum(x, axis: int):
    """sum(x, axis) as x[0] + x[1] + ... along `axis` (meant for axes of a few elements)."""
    terms = [x.take(i, axis=axis) for i in range(x.shape[axis])]
    out = terms[0]
    for term in terms[1:]:
        out = out + term
    return out


def first_argmax(x):
    """`jnp.argmax(x, axis=-1)` as int32: the first index of the maximum, or of the first NaN
    when the row has one (argmax's NaN rule), from a max and a min over indices.

    NOTE: 34 us -> a few us for a tiny verify step's [32, 256] logits on XLA CPU.
    """
    top = jnp.max(x, axis=-1, keepdims=True)  # NaN when the row has a NaN
    hit = (x == top) | jnp.isnan(x)
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(hit, index, jnp.int32(x.shape[-1])), axis=-1)
