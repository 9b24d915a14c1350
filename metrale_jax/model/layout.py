"""The scan layout of the layer stack: repeated layer groups stacked so the trunk compiles one
group body and loops over it, instead of unrolling every layer.

Owns: `layer_period` (the repeating pattern of (mixer kind, MoE or dense) in a config) and
`stack_layer_groups` (params with `layers` -> `layer_groups`, each leaf stacked over groups).
Invariant: `trunk` computes the same layers in the same order with either layout; compile time
of the stacked layout does not grow with the number of groups (a 48-layer Qwen3-Next compiles
one 4-layer body).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from metrale_jax.config import ModelConfig


def _signature(cfg: ModelConfig, i: int):
    return (cfg.layer_types[i], cfg.is_moe_layer(i))


def layer_period(cfg: ModelConfig) -> int:
    """The smallest P such that layer i has the same kind and FFN as layer i % P (P = L when
    nothing repeats)."""
    n = cfg.num_hidden_layers
    for p in range(1, n + 1):
        if n % p == 0 and all(_signature(cfg, i) == _signature(cfg, i % p) for i in range(n)):
            return p
    return n


def stack_layer_groups(params: dict, cfg: ModelConfig) -> dict:
    """Params in scan layout when the stack repeats (more than one group), else unchanged.
    layer_groups[j] holds layer j of every group, each leaf with a leading [groups] axis."""
    p = layer_period(cfg)
    groups = cfg.num_hidden_layers // p
    if groups == 1 or "layers" not in params:
        return params
    layers = params["layers"]
    stacked = [
        jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *[layers[g * p + j] for g in range(groups)]) for j in range(p)
    ]
    out = {k: v for k, v in params.items() if k != "layers"}
    out["layer_groups"] = stacked
    return out
