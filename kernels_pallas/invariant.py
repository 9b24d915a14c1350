"""The batch-invariant contractions of the kernels' references: `invariant_einsum`, a two-operand einsum whose
every output element is the same elementwise products summed by the same `pairwise_sum` tree, whatever the
operands' other dimensions (batch, query rows, heads) are.

Owns: `invariant_einsum` (what `ops.InvariantOps` passes as `contract` to the GDN recurrence and the paged
attention references) and `summed_axis_order` (where its product holds the contracted index: the larger operand's
layout kept, no per-call transpose of the GDN state or of a value tile).

Invariants:
- An output element depends only on the operand elements it contracts, summed over the one contracted index as
  a pairwise tree of elementwise adds (`reductions.pairwise_sum`): the same bits at any batch size, query count,
  tile count or position in the batch.
- Same values as `jnp.einsum(spec, a, b)` up to the order of the sum (and, with `preferred_element_type`, the
  operands widened to it first, as a dot with that result type does).

NOTE: why not `jnp.einsum`. XLA CPU lowers a batched contraction to a dot whose summation order depends on the
shapes (a one-row dot is a vector product, a several-row one a tiled kernel): a decode row and the same row in
a verify of K rows differed in the last bits. Elementwise ops round alike at every shape.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.reductions import pairwise_sum


def invariant_einsum(spec: str, a, b, preferred_element_type=None):
    """`jnp.einsum(spec, a, b)` for a spec "ab..,ab..->ab.." without ellipsis that contracts exactly one index,
    computed as a broadcast product summed by `pairwise_sum` over the contracted index (`summed_axis_order`
    says where that index sits in the product)."""
    inputs, out = spec.replace(" ", "").split("->")
    sa, sb = inputs.split(",")
    summed = [c for c in dict.fromkeys(sa + sb) if c not in out]
    if len(summed) != 1:
        raise ValueError(f"invariant_einsum contracts exactly one index: {spec!r} sums {summed}")
    order = summed_axis_order(out, summed[0], sa if a.size >= b.size else sb)
    dtype = preferred_element_type or jnp.result_type(a, b)

    def expand(x, labels: str):
        # x's axes moved into `order`, with a unit axis for each index x does not have.
        perm = sorted(range(len(labels)), key=lambda i: order.index(labels[i]))
        x = jnp.transpose(x, perm).astype(dtype)
        held = [labels[i] for i in perm]
        return x.reshape([x.shape[held.index(c)] if c in held else 1 for c in order])

    return pairwise_sum(expand(a, sa) * expand(b, sb), axis=order.index(summed[0]))


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
