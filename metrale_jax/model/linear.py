"""The model's dense projections.

Owns: `linear`, the x @ W.T every projection of the model uses (weights stored [out, in], as in
the checkpoints, or input-major as a `TransposedWeight`), `linear_per_expert` and
`linear_all_experts` (the same over an [E, out, in] expert stack), the input-major layout
(`TransposedWeight`, `transpose_weights`, `untranspose_weights`, `expert_weight`), expert stacks
held one leaf per expert (`ExpertLeaves`, `with_expert`), and
`linear_parts`, one product with a row-stacked weight split into its parts;
the mesh axis names and `tensor_groups`, the number of shards of the tensor axis a traced program
runs under (1 without a mesh).
Invariants: the product is computed in the activation dtype (no upcast). A `TransposedWeight` holds
the same values as its [out, in] weight; every product reads it in place. Under a tensor axis of
N shards a row-stacked leaf is stored group-major (`metrale_jax.engine.sharding`): N groups of
rows, group g holding every part's g-th N-th, so each device's contiguous rows hold its heads of
every part; `split_groups` splits such a feature axis, and with N = 1 it is the plain split.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kernels_cpu.rows_matmul.api import rows_matmul
from metrale_jax.model.fp8_linear import Fp8BlockWeight, dense_weight
from metrale_jax.model.invariant import invariant_product, products_invariant

# The device mesh's axes (`metrale_jax.engine.sharding` builds the mesh): heads, experts.
TENSOR_AXIS = "tp"
EXPERT_AXIS = "ep"
# The MoE experts are split over every device of the mesh, in this (major to minor) order.
EXPERT_AXES = (EXPERT_AXIS, TENSOR_AXIS)


def tensor_groups() -> int:
    """Shards of the tensor axis of the mesh the current trace runs under (`jax.set_mesh`); 1 without one."""
    return mesh_devices((TENSOR_AXIS,))


def mesh_devices(axes: tuple[str, ...]) -> int:
    """Devices of the current trace's mesh over `axes` (the product of their sizes; 1 without a mesh)."""
    shape = dict(jax.sharding.get_abstract_mesh().shape)
    return int(np.prod([shape.get(a, 1) for a in axes]))


def split_groups(y, sizes: tuple[int, ...], groups: int) -> tuple[jax.Array, ...]:
    """Split the last axis of y (group-major: `groups` groups, each the concatenation of every part's
    1/groups) into parts of sizes[i] features each (every size divisible by groups): a tuple of
    [..., sizes[i]], each in the part's own (head) order.
    NOTE: a reshape that puts the groups on an axis of their own keeps the split local to a device
    when the axis is sharded over the groups; slicing the flat axis would move rows between devices."""
    lead = y.shape[:-1]
    g = y.reshape(*lead, groups, y.shape[-1] // groups)
    cuts = np.cumsum([n // groups for n in sizes])[:-1].tolist()
    return tuple(part.reshape(*lead, n) for part, n in zip(jnp.split(g, cuts, axis=-1), sizes))


# Weight leaves `transpose_weights` stores input-major (the projections `linear` / `linear_per_expert` read), by key.
TRANSPOSED_LEAVES = frozenset(
    {"w_in", "wo", "out", "gate_up", "down", "shared_gate_up", "shared_down", "fc", "lm_head"}
)


@struct.dataclass
class TransposedWeight:
    """A weight w [..., out, in] stored input-major: t [..., in, out], t[..., i, o] = w[..., o, i].

    NOTE: XLA CPU's dot (YNNPACK) repacks an [out, in] weight read as x @ w.T into its kernel's
    layout at every call: the repacking was 50-65% of a product of 1-32 rows. Read as x @ t, the
    weight is already in that layout and is read once, in place, at every row count."""

    t: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape [..., out, in]."""
        return (*self.t.shape[:-2], self.t.shape[-1], self.t.shape[-2])

    @property
    def dtype(self):
        return self.t.dtype

    @classmethod
    def of(cls, w) -> TransposedWeight:
        """w [..., out, in] stored input-major (a copy, once, outside any step program)."""
        return cls(jnp.swapaxes(w, -1, -2))

    def weight(self):
        """The [..., out, in] array (`of`'s inverse)."""
        return jnp.swapaxes(self.t, -1, -2)


@struct.dataclass
class ExpertLeaves:
    """An expert stack w [..., E, out, in] held as one leaf per expert: experts[e] is w[..., e, :, :]
    (an array, or a `TransposedWeight` where the stack was input-major).

    NOTE: on XLA CPU a product's operand is a buffer of its own, so a product with one expert
    indexed out of a stack (the `pairs` MoE form's dynamic index) first copies that expert out.
    With a leaf per expert, `with_expert` picks the expert with a `lax.switch` whose branch reads
    its leaf in place."""

    experts: tuple

    @property
    def shape(self) -> tuple[int, ...]:
        """The stack's shape [..., E, out, in]."""
        one = self.experts[0].shape
        return (*one[:-2], len(self.experts), *one[-2:])

    @property
    def dtype(self):
        return self.experts[0].dtype

    @classmethod
    def of(cls, w) -> ExpertLeaves:
        """The stack w (an array or a `TransposedWeight`, experts on axis -3) split per expert (a
        copy, once, outside any step program)."""
        if isinstance(w, TransposedWeight):
            return cls(tuple(TransposedWeight(w.t[..., e, :, :]) for e in range(w.t.shape[-3])))
        return cls(tuple(w[..., e, :, :] for e in range(w.shape[-3])))

    def stack(self):
        """The [..., E, out, in] stack in the layout of its leaves (`of`'s inverse)."""
        if isinstance(self.experts[0], TransposedWeight):
            return TransposedWeight(jnp.stack([w.t for w in self.experts], axis=-3))
        return jnp.stack(self.experts, axis=-3)


def _transposable(path, leaf) -> bool:
    key = getattr(path[-1], "key", None)
    return key in TRANSPOSED_LEAVES and leaf.ndim >= 2 and leaf.dtype == jnp.float32


def transpose_weights(params):
    """The parameter tree with every float32 projection `linear` reads (`TRANSPOSED_LEAVES`) as a
    `TransposedWeight`; other leaves as they are. For a single-device XLA CPU engine
    (`transposed_layout_applies`)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: TransposedWeight.of(x) if _transposable(p, x) else x, params)


def untranspose_weights(params):
    """`transpose_weights`' inverse: every `TransposedWeight` back to its [..., out, in] array."""
    return jax.tree_util.tree_map(
        lambda x: x.weight() if isinstance(x, TransposedWeight) else x,
        params,
        is_leaf=lambda x: isinstance(x, TransposedWeight),
    )


def transposed_layout_applies(mesh) -> bool:
    """Whether an engine stores its projections input-major: on XLA CPU without a mesh. Other
    backends' matrix libraries read [out, in] weights without repacking them; under a mesh the
    leaves keep the layout their `PartitionSpec`s describe."""
    return mesh is None and jax.default_backend() == "cpu"


def expert_weight(w, e):
    """Expert e's [out, in] weight of an [E, out, in] stack in either layout (a dynamic index)."""
    if isinstance(w, TransposedWeight):
        return TransposedWeight(jax.lax.dynamic_index_in_dim(w.t, e, keepdims=False))
    if isinstance(w, Fp8BlockWeight):
        return w.map(lambda a: jax.lax.dynamic_index_in_dim(a, e, axis=a.ndim - 3, keepdims=False))
    return jax.lax.dynamic_index_in_dim(w, e, keepdims=False)


def with_expert(e, fn, stacks, *args):
    """fn(*(expert e's weight of each stack), *args) for a traced expert index e: a `lax.switch`
    whose branch reads its experts' own leaves in place when the stacks are `ExpertLeaves`, else
    the weights indexed out of the stacks (`expert_weight`)."""
    if isinstance(stacks[0], ExpertLeaves):
        branches = [functools.partial(fn, *weights) for weights in zip(*(s.experts for s in stacks))]
        return jax.lax.switch(e, branches, *args)
    return fn(*(expert_weight(s, e) for s in stacks), *args)


def linear(x, w):
    """x [..., in] @ w[out, in].T -> [..., out], in the activation dtype. An input-major weight's product of a
    few rows runs the CPU rows kernel (`kernels_cpu.rows_matmul`; XLA's dot where it does not apply); in the
    batch-invariant mode every product does (`metrale_jax.model.invariant`). An FP8 block-scaled weight is
    dequantised inside the product (`fp8_linear.dense_weight`)."""
    w = dense_weight(w, x)
    if products_invariant():
        return invariant_product(x, w.t if isinstance(w, TransposedWeight) else w.T)
    if isinstance(w, TransposedWeight):
        return rows_matmul(x, w.t)
    return jnp.einsum("...i,oi->...o", x, w)


def linear_per_expert(x, w):
    """x [E, C, in] @ w[E, out, in].T per expert -> [E, C, out]: `linear` batched over the expert
    axis (each expert's C rows against its own weight)."""
    if isinstance(w, ExpertLeaves):
        return jnp.stack([linear(x[e], we) for e, we in enumerate(w.experts)])
    if products_invariant():
        return jnp.stack([linear(x[e], expert_weight(w, e)) for e in range(x.shape[0])])
    w = dense_weight(w, x)
    if isinstance(w, TransposedWeight):
        return jnp.einsum("eci,eio->eco", x, w.t)
    return jnp.einsum("eci,eoi->eco", x, w)


def linear_all_experts(x, w):
    """x [R, in] against every expert of w [E, out, in] -> [R, E, out].
    NOTE: an [E, out, in] stack is one [E * out, in] projection (a reshape); an input-major stack
    is not, and a contraction over it with the experts as free dimensions makes XLA CPU copy the
    weight into another layout: it runs batched over the experts instead, the rows broadcast."""
    if isinstance(w, ExpertLeaves):
        return jnp.stack([linear(x, we) for we in w.experts], axis=-2)
    w = dense_weight(w, x)
    if isinstance(w, TransposedWeight):
        e = w.t.shape[0]
        return jnp.swapaxes(linear_per_expert(jnp.broadcast_to(x, (e, *x.shape)), w), 0, 1)
    return linear(x, w.reshape(-1, w.shape[-1])).reshape(x.shape[0], w.shape[0], w.shape[1])


def linear_parts(x, w, rows: tuple[int, ...], groups: int | None = None) -> tuple[jax.Array, ...]:
    """The projections x @ w_i.T of a row-stacked w = [w_0; w_1; ...] ([sum(rows), in]; w_i has
    rows[i] rows, group-major in `groups` groups — by default `tensor_groups()`; 1 for a replicated
    leaf —: `split_groups`) as one product: a tuple of [..., rows[i]].

    NOTE: XLA does not merge products that share an input, and a small step pays a launch for
    each; the parameter tree stores such projections stacked (see
    `metrale_jax.params`).
    """
    chex.assert_equal(tuple(w.shape), (sum(rows), x.shape[-1]))
    groups = tensor_groups() if groups is None else groups
    return split_groups(linear(x, dense_weight(w, x, groups)), rows, groups)
