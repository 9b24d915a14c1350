"""The reductions of the model and of the kernels' references, written so that their bits do not
depend on the program around them, with the semantics of the plain ones.

Owns: `pairwise_sum` (a shape-invariant sum over one axis, the last by default: the attention kernel's interpreted
body, its reference, and the model's norms and softmaxes), `ordered_sum` (terms added left to right,
index 0 first, in the input's dtype, whatever the array's shape), `first_argmax` (`jnp.argmax`
over the last axis, int32), `fenced` (a softmax's max kept out of its exponentials' fusion in the
batch-invariant mode) and `log_softmax` (its batch-invariant form there).

It lives with the kernels because the kernels use it and must not import the model; the model and
the engine import it from here (layering: model -> kernels).

NOTE: XLA CPU runs a reduction over a narrow axis (the GDN conv's taps, the MoE's top-k routing
weights) as a library call where a chain of elementwise adds fuses into its neighbours, and
argmax's paired (value, index) reduction as a scalar loop; `ordered_sum` and `first_argmax` are
the vectorisable forms.
"""

from __future__ import annotations

import jax
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


def fenced(m, fence: bool):
    """`m` (a softmax's row max), behind an optimization barrier when `fence` (the batch-invariant mode).

    NOTE: XLA CPU fuses a row max with the exp(x - max) that consumes it, and from some array size on
    (4,096 elements of rows 8 or 16 wide, the MoE router's softmax at 512 or 256 rows) that fusion
    rounds the exponentials differently from the same rows in a smaller array: a long prefill's routing
    weights then differed from a chunk's in the last bit. Behind the barrier the max is a reduction of
    its own and exp(x - max) an elementwise fusion, which rounds alike at every shape. Outside the mode
    the fusion stays (the default mode's bits are unchanged)."""
    return lax.optimization_barrier(m) if fence else m


def log_softmax(x, invariant: bool):
    """`jax.nn.log_softmax(x, axis=-1)`; `invariant` (the batch-invariant mode): x - m - log(sum(exp(x - m)))
    with the max `fenced` and the sum a `pairwise_sum`, the same bits for a row in any batch.
    NOTE: jax's form sums with `jnp.sum`, whose order on XLA CPU depends on the rows around a row (a
    2,048-wide row differed between one row and two)."""
    if not invariant:
        return jax.nn.log_softmax(x, axis=-1)
    shifted = x - fenced(jnp.max(x, axis=-1, keepdims=True), True)
    return shifted - jnp.log(pairwise_sum(jnp.exp(shifted)))[..., None]


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
