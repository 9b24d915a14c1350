"""Placement: where the engine's weights and pool live, and moving them to another mesh.

Owns `place_params` (the weights on one mesh, or on the default device in the backend's layout)
and `reshard` (weights and pool from one placement to another). The layout of each leaf on a
mesh is `engine.sharding`'s; the backend's weight layout is `model.weight_layout`'s.

Invariants:
- A reshard goes through the checkpoint layout (weights in checkpoint order, unsharded; the pool
  in checkpoint channel order), so any placement reaches any other and a round trip is exact.
- Host bookkeeping is global (`sharding`): nothing here reads or changes it.
"""

from __future__ import annotations

from jax.sharding import Mesh

from metrale_jax.config import ModelConfig
from metrale_jax.engine.pool import EnginePool
from metrale_jax.engine.sharding import canonical_pool, place_pool, shard_params, unshard_params
from metrale_jax.model.weight_layout import backend_layout, checkpoint_layout


def place_params(params: dict, cfg: ModelConfig, mesh: Mesh | None) -> dict:
    """The engine's weights: sharded over `mesh`, or on the default device in this backend's layout
    (`backend_layout`: on XLA CPU input-major, experts one leaf each where that applies)."""
    return backend_layout(params, cfg, mesh) if mesh is None else shard_params(params, cfg, mesh)


def reshard(
    params: dict, pool: EnginePool, cfg: ModelConfig, old: Mesh | None, new: Mesh | None
) -> tuple[dict, EnginePool]:
    """`params` (placed by `place_params`) and `pool`, placed on mesh `old`, moved to mesh `new`
    (None: the default device)."""
    params, pool = unshard_params(checkpoint_layout(params), cfg, old), canonical_pool(pool, cfg, old)
    return place_params(params, cfg, new), place_pool(pool, cfg, new)
