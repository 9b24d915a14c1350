"""The 80B's step programs lowered for an abstract mesh of 8 H200s (tensor parallel 2 x expert parallel
4) on any machine, no GPU needed: prefill, decode, verify, propose and the fused step at the recipe's
shapes, weights and pool sharded as the engine shards them (`engine.sharding`), the `xla` forward or the
`pallas` one (its kernels as Triton calls, each in a shard_map over the heads).

Owns: `MODEL` (the recipe model lowered), `h200_mesh`, `first_layers` and `lower`. `make test` lowers one
layer group (tests/test_sharding_lowering.py); `python scripts/sharded_lowering.py` every layer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType

from kernels_pallas.ops import Ops, ReferenceOps
from metrale_jax.config import ModelConfig
from metrale_jax.engine.settings import resolve_settings
from metrale_jax.engine.sharding import EP, TP, check_mesh
from metrale_jax.memory.activations import exported_step_programs
from metrale_jax.memory.source import resolve_model

try:
    from jax.sharding import AbstractDevice
except ImportError:  # jax 0.11.x
    from jax._src.mesh import AbstractDevice  # type: ignore[attr-defined,no-redef]

MODEL = "Qwen/Qwen3-Next-80B-A3B-Instruct"


def h200_mesh(tp: int, ep: int) -> AbstractMesh:
    """An abstract (ep, tp) mesh of H200s."""
    device = AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
    return AbstractMesh((ep, tp), (EP, TP), axis_types=(AxisType.Auto,) * 2, abstract_device=device)


def first_layers(cfg: ModelConfig, layers: int | None) -> ModelConfig:
    """`cfg` cut to its first `layers` layers (None: unchanged)."""
    if layers is None:
        return cfg
    return dataclasses.replace(cfg, num_hidden_layers=layers, layer_types=cfg.layer_types[:layers])


def lower(model: str, recipes_dir: Path, layers: int | None, tp: int = 2, ep: int = 4, ops: Ops | None = None) -> dict:
    """{program: Exported} of `model` (a `recipes_dir`/models id) cut to `layers`, on tp x ep H200s,
    with `ops` (default the `xla` forward's)."""
    cfg = first_layers(resolve_model(model, recipes_dir).config, layers)
    check_mesh(cfg, tp, ep, tp * ep)
    settings = resolve_settings(
        {
            "max_batch_size": "8",
            "max_seq_len": 4096,
            "speculative": True,
            "num_drafts": 3,
            "kv_cache_dtype": "bf16",
            "tensor_parallel_size": tp,
            "expert_parallel_size": ep,
        },
        None,
        auto_slots=8,
    )
    ops = ReferenceOps() if ops is None else ops
    return exported_step_programs(cfg, settings, h200_mesh(tp, ep), jnp.bfloat16, ops, "cuda")
