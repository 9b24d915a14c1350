"""The parameter tree as a single-device engine on this backend holds it.

Owns: `backend_layout`, the one call by which the engine lays out its weights and the memory
planner its abstract ones, and its inverse `checkpoint_layout`.

Invariants: the layout changes where values live, never the values: on XLA CPU without a mesh
the float32 projections are input-major (`linear.TransposedWeight`) and, where the MoE's `pairs`
form runs one-row steps (`mlp.expert_leaves_apply`), each expert stack is one leaf per expert
(`linear.ExpertLeaves`); elsewhere (other backends, under a mesh) the tree is the checkpoint's,
whose `PartitionSpec`s the sharding describes. `checkpoint_layout(backend_layout(p, cfg, mesh))`
equals p leaf for leaf.
"""

from __future__ import annotations

from metrale_jax.config import ModelConfig
from metrale_jax.model.linear import transpose_weights, transposed_layout_applies, untranspose_weights
from metrale_jax.model.mlp import expert_leaves_apply, join_expert_stacks, split_expert_stacks


def backend_layout(params, cfg: ModelConfig, mesh):
    """The unsharded parameter tree as an engine on this backend holds it under `mesh` (arrays, or
    shape structs inside `jax.eval_shape`: the planner lays out its abstract weights with the same
    call)."""
    if not transposed_layout_applies(mesh):
        return params
    params = transpose_weights(params)
    return split_expert_stacks(params) if expert_leaves_apply(cfg) else params


def checkpoint_layout(params):
    """`backend_layout`'s inverse: every expert stack one array again, every projection [..., out, in]."""
    return untranspose_weights(join_expert_stacks(params))
