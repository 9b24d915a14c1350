"""Lower the 80B's step programs for an abstract mesh of 8 H200s (tensor parallel 2 x expert parallel 4)
on this machine, no GPU needed: prefill, decode, verify and propose at the recipe's shapes, weights
and pool sharded as the engine shards them (`engine.sharding`), the `xla` forward or the `pallas` one
(its kernels as Triton calls, each in a shard_map over the heads).

Usage: python scripts/sharded_lowering.py [--layers N] [--model ID] [--forward xla|pallas]
(N: the first N layers; default every layer. `make test` lowers one layer group:
tests/test_sharding_lowering.py.) Prints one line per program: devices, the module's size, the
MoE's all-reduces (shard_map), the Triton calls and the seconds lowering took.
"""

from __future__ import annotations

import dataclasses
import time

import click

from metrale_jax import runtime_env

runtime_env.prepare(cpu_only=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AbstractMesh, AxisType  # noqa: E402

from kernels_pallas.common import TRITON_CALL  # noqa: E402
from kernels_pallas.ops import Ops, PallasOps, ReferenceOps  # noqa: E402
from metrale_jax.config import ModelConfig  # noqa: E402
from metrale_jax.engine.settings import resolve_settings  # noqa: E402
from metrale_jax.engine.sharding import EP, TP, check_mesh  # noqa: E402
from metrale_jax.memory.activations import exported_step_programs  # noqa: E402
from metrale_jax.memory.source import resolve_model  # noqa: E402
from metrale_jax.recipes import REPO_RECIPES_DIR  # noqa: E402

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


def lower(model: str, layers: int | None, tp: int = 2, ep: int = 4, ops: Ops | None = None) -> dict:
    """{program: Exported} of `model` (a recipes/models id) cut to `layers`, on tp x ep H200s, with
    `ops` (default the `xla` forward's)."""
    cfg = first_layers(resolve_model(model, REPO_RECIPES_DIR).config, layers)
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


@click.command(help=__doc__.splitlines()[0])
@click.option("--layers", type=int, default=None, help="the first N layers (default: every layer)")
@click.option("--model", default=MODEL, show_default=True)
@click.option("--forward", type=click.Choice(["xla", "pallas"]), default="xla", show_default=True)
def main(layers: int | None, model: str, forward: str) -> None:
    t0 = time.perf_counter()
    ops = PallasOps(interpret=False) if forward == "pallas" else ReferenceOps()
    for name, exp in lower(model, layers, ops=ops).items():
        text = exp.mlir_module()
        print(
            f"{name}: {exp.nr_devices} devices, {len(text) / 1e6:.1f} MB, all_reduce x{text.count('all_reduce')}, "
            f"Triton calls x{text.count(TRITON_CALL)}"
        )
    if forward == "pallas":
        print(f"kernels refused (the reference ran): {list(PallasOps.refusals()) or 'none'}")
    print(f"lowered in {time.perf_counter() - t0:.1f} s (jax {jax.__version__})")


if __name__ == "__main__":
    main()
