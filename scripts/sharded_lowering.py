"""Lower the 80B's step programs for an abstract mesh of 8 H200s (tensor parallel 2 x expert parallel 4)
on this machine, no GPU needed (`metrale_jax.sharded_lowering`).

Usage: python scripts/sharded_lowering.py [--layers N] [--model ID] [--forward xla|pallas]
(N: the first N layers; default every layer.) Prints one line per program: devices, the module's size,
the MoE's all-reduces (shard_map), the Triton calls and the seconds lowering took.
"""

from __future__ import annotations

import time

import click

from metrale_jax import runtime_env

runtime_env.prepare(cpu_only=True)

import jax  # noqa: E402

from kernels_pallas.common import TRITON_CALL  # noqa: E402
from kernels_pallas.ops import PallasOps, ReferenceOps  # noqa: E402
from metrale_jax.sharded_lowering import MODEL, lower  # noqa: E402
from metrale_jax_cli.recipes import REPO_RECIPES_DIR  # noqa: E402


@click.command(help=__doc__.splitlines()[0])
@click.option("--layers", type=int, default=None, help="the first N layers (default: every layer)")
@click.option("--model", default=MODEL, show_default=True)
@click.option("--forward", type=click.Choice(["xla", "pallas"]), default="xla", show_default=True)
def main(layers: int | None, model: str, forward: str) -> None:
    t0 = time.perf_counter()
    ops = PallasOps(interpret=False) if forward == "pallas" else ReferenceOps()
    for name, exp in lower(model, REPO_RECIPES_DIR, layers, ops=ops).items():
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
