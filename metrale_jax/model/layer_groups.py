"""The two layouts of the layer stack's parameters, and the layer groups of the scan layout.

Owns: `StackLayout` (`list`: `layers`, one parameter tree per layer, the default; `scan`:
`layer_groups`, the repeated groups stacked so the trunk compiles one group body and loops over
it), `layer_period` (the repeating pattern of (mixer kind, MoE or dense) in a config),
`stack_layer_groups` and `arrange_layers` (params in a named layout), `layer_groups` and
`truncate_groups` (the same model cut to its first groups, for the memory planner's depth probes).

Invariants:
- `trunk` computes the same layers in the same order with either layout.
- list: every layer's weights are arguments of the program, each read in place by the products
  that use it (no program copies a layer's weights: `ProgramInfo.param_copies` is 0).
- scan: compile time does not grow with the number of groups (a 48-layer Qwen3-Next compiles
  one 4-layer body), but each step materialises every group's weights: the body reads group g's
  slice of each stacked leaf, and on XLA CPU the operand of a product must be a buffer of its
  own, so that slice (a dynamic-slice in the loop, a slice when XLA unrolls a short loop) is
  copied out at every step (`ProgramInfo.param_copies` counts them). Hence list is the default
  and scan an option for deep stacks where compile time matters more.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

import jax
import jax.numpy as jnp

from metrale_jax.config import ModelConfig
from metrale_jax.errors import MetraleError

StackLayout = Literal["list", "scan"]
STACK_LAYOUTS: tuple[str, ...] = get_args(StackLayout)


class StackLayoutError(MetraleError, ValueError):
    """A layout name that is not one of `STACK_LAYOUTS`."""


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


def layer_groups(cfg: ModelConfig) -> int:
    """How many times the layer period repeats (1 when nothing repeats)."""
    return cfg.num_hidden_layers // layer_period(cfg)


def truncate_groups(cfg: ModelConfig, groups: int) -> ModelConfig:
    """`cfg` with only its first `groups` layer groups (1 <= groups <= layer_groups(cfg)): every
    kept layer has the kind and FFN it had; MTP layers, widths and vocabulary unchanged."""
    assert 1 <= groups <= layer_groups(cfg), (groups, layer_groups(cfg))
    n = groups * layer_period(cfg)
    return dataclasses.replace(
        cfg,
        num_hidden_layers=n,
        layer_types=cfg.layer_types[:n],
        mlp_only_layers=tuple(i for i in cfg.mlp_only_layers if i < n),
    )


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


def arrange_layers(params: dict, cfg: ModelConfig, layout: str) -> dict:
    """List-layout `params` in `layout`: unchanged for `list`, `stack_layer_groups` for `scan`.
    Raises StackLayoutError for another name."""
    if layout not in STACK_LAYOUTS:
        raise StackLayoutError(f"unknown layout {layout!r} (choose from {', '.join(STACK_LAYOUTS)})")
    return stack_layer_groups(params, cfg) if layout == "scan" else params
