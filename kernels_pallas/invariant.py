"""The batch-invariant contractions of the kernels' references: `invariant_einsum`, a two-operand einsum whose
every output element is the same elementwise products summed by the same `pairwise_sum` tree, whatever the
operands' other dimensions (batch, query rows, heads) are.

Owns: `invariant_einsum` (what `ops.InvariantOps` passes as `contract` to the GDN recurrence and the paged
attention references), `UNROLLED_MAX` (the longest contraction it writes as an unrolled tree of slice products) and
`summed_axis_order` (where the materialised product of a longer one holds the contracted index: the larger
operand's layout kept, no per-call transpose of the GDN state or of a value tile).

Invariants:
- An output element depends only on the operand elements it contracts, summed over the one contracted index as
  a pairwise tree of elementwise adds (`reductions.pairwise_sum`): the same bits at any batch size, query count,
  tile count or position in the batch.
- Same values as `jnp.einsum(spec, a, b)` up to the order of the sum (and, with `preferred_element_type`, the
  operands widened to it first, as a dot with that result type does).

NOTE: why not `jnp.einsum`. XLA CPU lowers a batched contraction to a dot whose summation order depends on the
shapes (a one-row dot is a vector product, a several-row one a tiled kernel): a decode row and the same row in
a verify of K rows differed in the last bits. Elementwise ops round alike at every shape.

NOTE: the unrolled tree. A contraction of a power-of-two length n <= `UNROLLED_MAX` is written as the tree itself,
node(l, i) = node(l - 1, i) + node(l - 1, i + n >> l) over leaves a[.., i, ..] * b[.., i, ..] (the operands' slices
at index i, broadcast to the output): the very adds of `pairwise_sum`'s first-half + second-half tree, so the same
bits, but XLA fuses the whole tree into one loop that keeps the partial sums in registers, where the broadcast
product summed by `pairwise_sum` is materialised (n times the output) and read back level by level (BUILD_NOTES has
the long prefill's attention before and after). Other lengths (zero-padded by `pairwise_sum`) keep the
materialised product.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kernels_pallas.reductions import pairwise_sum

#: The longest contracted index `invariant_einsum` unrolls (each leaf and each add is an op of the program).
UNROLLED_MAX = 256


def invariant_einsum(spec: str, a, b, preferred_element_type=None):
    """`jnp.einsum(spec, a, b)` for a spec "ab..,ab..->ab.." without ellipsis that contracts exactly one index,
    computed as a broadcast product summed by `pairwise_sum` over the contracted index: unrolled (`_leaf_tree`)
    for a power-of-two length up to `UNROLLED_MAX`, else materialised (`summed_axis_order` says where that index
    sits in the product)."""
    inputs, out = spec.replace(" ", "").split("->")
    sa, sb = inputs.split(",")
    summed = [c for c in dict.fromkeys(sa + sb) if c not in out]
    if len(summed) != 1:
        raise ValueError(f"invariant_einsum contracts exactly one index: {spec!r} sums {summed}")
    dtype = preferred_element_type or jnp.result_type(a, b)
    n = a.shape[sa.index(summed[0])] if summed[0] in sa else b.shape[sb.index(summed[0])]
    if 0 < n <= UNROLLED_MAX and n & (n - 1) == 0:
        return _leaf_tree(a, sa, b, sb, out, summed[0], n, dtype)
    order = summed_axis_order(out, summed[0], sa if a.size >= b.size else sb)

    def expand(x, labels: str):
        # x's axes moved into `order`, with a unit axis for each index x does not have.
        perm = sorted(range(len(labels)), key=lambda i: order.index(labels[i]))
        x = jnp.transpose(x, perm).astype(dtype)
        held = [labels[i] for i in perm]
        return x.reshape([x.shape[held.index(c)] if c in held else 1 for c in order])

    return pairwise_sum(expand(a, sa) * expand(b, sb), axis=order.index(summed[0]))


def _leaf_tree(a, sa: str, b, sb: str, out: str, summed: str, n: int, dtype):
    """The contraction over `summed` (length n, a power of two) as `pairwise_sum`'s tree written out: leaf i is
    the product of the operands' slices at index i, each broadcast to `out`'s axes (an operand without the
    index is the same at every leaf)."""

    def at(x, labels: str, i: int):
        # x's slice at index i of `summed` (x itself where it has no such index), in `out`'s axis order.
        if summed in labels:
            x, labels = lax.index_in_dim(x, i, labels.index(summed), keepdims=False), labels.replace(summed, "")
        perm = sorted(range(len(labels)), key=lambda j: out.index(labels[j]))
        x = jnp.transpose(x, perm).astype(dtype)
        held = [labels[j] for j in perm]
        return x.reshape([x.shape[held.index(c)] if c in held else 1 for c in out])

    def node(level: int, i: int):
        if level == 0:
            return at(a, sa, i) * at(b, sb, i)
        return node(level - 1, i) + node(level - 1, i + (n >> level))

    # NOTE: the barrier keeps XLA from fusing the tree into each of its consumers: the attention's scores feed
    # the running max and the exponentials, and each fusion computed the whole tree again.
    return lax.optimization_barrier(node(n.bit_length() - 1, 0))


def summed_axis_order(out: str, summed: str, larger: str) -> str:
    """The axes of the broadcast product: `out`'s, with `summed` placed before the first output index that
    follows it in the larger operand's labels `larger`, or where none does, before the last output index.

    NOTE: the larger operand (the GDN state [b, h, k, v], the attention's value tile [b, g, s, d]) then keeps
    its layout, where a summed index moved last transposed it at every row; and the product's minor axis is
    an output index, so the sum tree adds contiguous vectors (a sum over the minor axis, the attention scores'
    d, read the key tile with a stride of d for every output vector). The product and its sum tree per output
    element are the same whatever the position, so the bits are too."""
    after = [c for c in larger[larger.index(summed) + 1 :] if c in out] if summed in larger else []
    at = out.index(after[0]) if after else max(len(out) - 1, 0)
    return out[:at] + summed + out[at:]
