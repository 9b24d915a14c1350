"""The reductions of the model and of the kernels' references, written so that their bits do not
depend on the program around them, with the semantics of the plain ones.

Owns: `pairwise_sum` (a shape-invariant sum over one axis, the last by default: the attention kernel's interpreted
body, its reference, and the model's norms and softmaxes), `ordered_sum` (terms added left to right,
index 0 first, in the input's dtype, whatever the array's shape) and `first_argmax` (`jnp.argmax`
over the last axis, int32).

It lives with the kernels because the kernels use it and must not import the model; the model and
the engine import it from here (layering: model -> kernels).

NOTE: XLA CPU runs a reduction over a narrow axis (the GDN conv's taps, the MoE's top-k routing
weights) as a library call where a chain of elementwise adds fuses into its neighbours, and
argmax's paired (value, index) reduction as a scalar loop; `ordered_sum` and `first_argmax` are
the vectorisable forms.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def pairwise_sum(x, axis: int = -1):
    """Sum over `axis` (the last by default) as a pairwise tree of elementwise adds (first half + second
    half; the length is zero-padded to a power of two). An element's tree is the same along any axis.

    NOTE: not `jnp.sum`: XLA CPU sums an axis in an order that depends on the array's shape and on
    what the reduction is fused with (large arrays go to YNNPACK, smaller ones are split into
    windows), so the same row summed in a [M, tile] kernel block and in a [B, KV, M, tile] batch,
    or normalised in two programs that fuse its producer differently, differs in the last bit.
    Elementwise adds round alike at any shape and in any fusion.
    """
    axis = axis % x.ndim
    n = x.shape[axis]
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, (1 << (n - 1).bit_length()) - n)
    x = jnp.pad(x, pad)
    # NOTE: lax ops, not `x[..., :half] + ...`: the same primitives, traced without NumPy indexing's
    # rewriting and type promotion, which cost most of this tree's tracing (it runs in every norm).
    while x.shape[axis] > 1:
        half = x.shape[axis] // 2
        x = lax.add(lax.slice_in_dim(x, 0, half, axis=axis), lax.slice_in_dim(x, half, 2 * half, axis=axis))
    return lax.squeeze(x, (axis,))


def ordered_sum(x, axis: int):
    """sum(x, axis) as x[0] + x[1] + ... along `axis` (meant for axes of a few elements)."""
    terms = [x.take(i, axis=axis) for i in range(x.shape[axis])]
    out = terms[0]
    for term in terms[1:]:
        out = out + term
    return out


def first_argmax(x):
    """`jnp.argmax(x, axis=-1)` as int32: the first index of the maximum, or of the first NaN
    when the row has one (argmax's NaN rule), from a max and a min over indices."""
    top = jnp.max(x, axis=-1, keepdims=True)  # NaN when the row has a NaN
    hit = (x == top) | jnp.isnan(x)
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(hit, index, jnp.int32(x.shape[-1])), axis=-1)
