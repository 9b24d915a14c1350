"""The model's dense projections.

Owns: `linear`, the x @ W.T every projection of the model uses (weights stored [out, in], as in
the checkpoints, or as a `TiledWeight`), `linear_per_expert` (the same, batched over a leading
expert axis of both), the tiled weight layout (`TiledWeight`, `tile_weights`, `untile_weights`,
and `expert_weight`, `merge_experts`, which read either layout), and
`linear_parts`, one product with a row-stacked weight split into its parts;
the mesh axis names and `tensor_groups`, the number of shards of the tensor axis a traced program
runs under (1 without a mesh).
Invariants: the product is computed in the activation dtype (no upcast). A `TiledWeight` holds the
same values as its [out, in] weight (zero rows pad `out` to whole tiles; products drop their
columns); every product reads it in place. Under a tensor axis of
N shards a row-stacked leaf is stored group-major (`metrale_jax.engine.sharding`): N groups of
rows, group g holding every part's g-th N-th, so each device's contiguous rows hold its heads of
every part; `split_groups` splits such a feature axis, and with N = 1 it is the plain split.
"""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

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


# A `TiledWeight`'s tile: output features per tile.
TILE = 64
# Weight leaves `tile_weights` tiles (the projections `linear` / `linear_per_expert` read), by key.
TILED_LEAVES = frozenset({"w_in", "wo", "out", "gate_up", "down", "shared_gate_up", "shared_down", "fc", "lm_head"})
# At most this many rows per tile go through the batched product; more, through one contraction.
TILED_BATCHED_MAX_ROWS = 64


@struct.dataclass
class TiledWeight:
    """A weight w [..., out, in] as tiles [..., ceil(out / TILE), in, TILE]: tiles[..., b, i, t] =
    w[..., b * TILE + t, i], zero past `out`.

    NOTE: XLA CPU's dot (YNNPACK) repacks an [out, in] weight read as x @ w.T into its kernel's
    layout at every call: the repacking was 50-65% of a product of 1-32 rows. Stored [in, TILE] per
    tile (output features contiguous), a weight is the layout the kernel reads, and a batch of
    [rows, in] @ [in, TILE] products over the tiles reads each tile once, contiguously: 1.7-2.5x the
    speed of x @ w.T at 2-8 rows, at 1 row as fast."""

    tiles: jax.Array
    out: int = struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape [..., out, in]."""
        return (*self.tiles.shape[:-3], self.out, self.tiles.shape[-2])

    @property
    def dtype(self):
        return self.tiles.dtype


def tile_weight(w) -> TiledWeight:
    """w [..., out, in] as a `TiledWeight` (a copy, once, outside any step program)."""
    *lead, out, n_in = w.shape
    blocks = -(-out // TILE)
    padded = jnp.pad(w, [(0, 0)] * len(lead) + [(0, blocks * TILE - out), (0, 0)])
    tiles = jnp.swapaxes(padded.reshape(*lead, blocks, TILE, n_in), -1, -2)
    return TiledWeight(tiles, out)


def untile_weight(w: TiledWeight):
    """`tile_weight`'s inverse: the [..., out, in] array."""
    *lead, blocks, n_in, _ = w.tiles.shape
    return jnp.swapaxes(w.tiles, -1, -2).reshape(*lead, blocks * TILE, n_in)[..., : w.out, :]


def _tileable(path, leaf) -> bool:
    key = getattr(path[-1], "key", None)
    return (
        key in TILED_LEAVES
        and leaf.ndim >= 2
        and leaf.dtype == jnp.float32
        and leaf.shape[-2] >= TILE
        # an expert stack's experts merge into one [E * out, in] weight (`merge_experts`): whole tiles only
        and (leaf.ndim == 2 or leaf.shape[-2] % TILE == 0)
    )


def tile_weights(params):
    """The parameter tree with every float32 projection `linear` reads (`TILED_LEAVES`, at least
    one tile of outputs) as a `TiledWeight`; other leaves as they are. For a single-device XLA CPU
    engine (`tiled_layout_applies`)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: tile_weight(x) if _tileable(p, x) else x, params)


def untile_weights(params):
    """`tile_weights`' inverse: every `TiledWeight` back to its [..., out, in] array."""
    return jax.tree_util.tree_map(
        lambda x: untile_weight(x) if isinstance(x, TiledWeight) else x,
        params,
        is_leaf=lambda x: isinstance(x, TiledWeight),
    )


def tiled_layout_applies(mesh) -> bool:
    """Whether an engine tiles its weights: on XLA CPU without a mesh. Other backends' matrix
    libraries read [out, in] weights without repacking them; under a mesh the leaves keep the
    layout their `PartitionSpec`s describe."""
    return mesh is None and jax.default_backend() == "cpu"


def backend_layout(params, mesh):
    """The unsharded parameter tree as an engine on this backend holds it under `mesh`: tiled
    where `tiled_layout_applies`, else unchanged (arrays, or shape structs inside `jax.eval_shape`:
    the planner lays out its abstract weights with the same call)."""
    return tile_weights(params) if tiled_layout_applies(mesh) else params


def expert_weight(w, e):
    """Expert e's [out, in] weight of an [E, out, in] stack in either layout (a dynamic index)."""
    if isinstance(w, TiledWeight):
        return TiledWeight(jax.lax.dynamic_index_in_dim(w.tiles, e, keepdims=False), w.out)
    return jax.lax.dynamic_index_in_dim(w, e, keepdims=False)


def merge_experts(w):
    """An [E, out, in] stack as one [E * out, in] weight, in either layout (a reshape, no copy)."""
    if isinstance(w, TiledWeight):
        return TiledWeight(w.tiles.reshape(-1, *w.tiles.shape[-2:]), w.tiles.shape[0] * w.out)
    return w.reshape(-1, w.shape[-1])


def linear(x, w):
    """x [..., in] @ w[out, in].T -> [..., out], in the activation dtype."""
    if not isinstance(w, TiledWeight):
        return jnp.einsum("...i,oi->...o", x, w)
    rows, n_in = math.prod(x.shape[:-1]), x.shape[-1]
    x2 = x.reshape(rows, n_in)
    blocks = w.tiles.shape[0]
    if rows <= TILED_BATCHED_MAX_ROWS:
        # NOTE: the rows broadcast over the tiles make one batched product whose every batch reads
        # its tile contiguously; past a few dozen rows one contraction over the tiles is faster.
        y = jax.lax.dot_general(jnp.broadcast_to(x2, (blocks, rows, n_in)), w.tiles, (((2,), (1,)), ((0,), (0,))))
        y = jnp.swapaxes(y, 0, 1)
    else:
        y = jnp.einsum("ri,bit->rbt", x2, w.tiles)
    return y.reshape(rows, blocks * TILE)[:, : w.out].reshape(*x.shape[:-1], w.out)


def linear_per_expert(x, w):
    """x [E, C, in] @ w[E, out, in].T per expert -> [E, C, out]: `linear` batched over the expert
    axis (each expert's C rows against its own weight)."""
    if not isinstance(w, TiledWeight):
        return jnp.einsum("eci,eoi->eco", x, w)
    e, c, n_in = x.shape
    blocks = w.tiles.shape[1]
    if c <= TILED_BATCHED_MAX_ROWS:
        xb = jnp.broadcast_to(x[:, None], (e, blocks, c, n_in))
        y = jax.lax.dot_general(xb, w.tiles, (((3,), (2,)), ((0, 1), (0, 1))))  # [E, b, C, T]
        y = jnp.swapaxes(y, 1, 2)
    else:
        y = jnp.einsum("eci,ebit->ecbt", x, w.tiles)
    return y.reshape(e, c, blocks * TILE)[..., : w.out]


def linear_parts(x, w, rows: tuple[int, ...], groups: int | None = None) -> tuple[jax.Array, ...]:
    """The projections x @ w_i.T of a row-stacked w = [w_0; w_1; ...] ([sum(rows), in]; w_i has
    rows[i] rows, group-major in `groups` groups — by default `tensor_groups()`; 1 for a replicated
    leaf —: `split_groups`) as one product: a tuple of [..., rows[i]].

    NOTE: XLA does not merge products that share an input, and a small step pays a launch for
    each; the parameter tree stores such projections stacked (see
    `metrale_jax.params`).
    """
    chex.assert_equal(tuple(w.shape), (sum(rows), x.shape[-1]))
    return split_groups(linear(x, w), rows, tensor_groups() if groups is None else groups)
