"""The model's dense projections.

Owns: `linear`, the x @ W.T every projection of the model uses (weights stored [out, in], as in
the checkpoints), and `linear_parts`, one product with a row-stacked weight split into its parts;
the mesh axis names and `tensor_groups`, the number of shards of the tensor axis a traced program
runs under (1 without a mesh).
Invariants: the product is computed in the activation dtype (no upcast). Under a tensor axis of
N shards a row-stacked leaf is stored group-major (`metrale_jax.engine.sharding`): N groups of
rows, group g holding every part's g-th N-th, so each device's contiguous rows hold its heads of
every part; `split_groups` splits such a feature axis, and with N = 1 it is the plain split.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

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


def linear(x, w):
    """x [..., in] @ w[out, in].T -> [..., out], in the activation dtype."""
    return jnp.einsum("...i,oi->...o", x, w)


def linear_parts(x, w, rows: tuple[int, ...], groups: int | None = None) -> tuple[jax.Array, ...]:
    """The projections x @ w_i.T of a row-stacked w = [w_0; w_1; ...] ([sum(rows), in]; w_i has
    rows[i] rows, group-major in `groups` groups — by default `tensor_groups()`; 1 for a replicated
    leaf —: `split_groups`) as one product: a tuple of [..., rows[i]].

    NOTE: XLA does not merge products that share an input, and a small step pays a launch for
    each; the parameter tree stores such projections stacked (see
    `metrale_jax.params`).
    """
    chex.assert_shape(w, (sum(rows), x.shape[-1]))
    return split_groups(linear(x, w), rows, tensor_groups() if groups is None else groups)
