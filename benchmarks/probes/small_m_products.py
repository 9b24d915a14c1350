"""Probe `small-m-products`: XLA CPU's products of a few rows against the engine's CPU rows kernel
(`kernels_cpu.rows_matmul`), on the same input-major weights (`linear.TransposedWeight`, what the single-device CPU
engine runs), alternated in one process.

    .venv/bin/python -m benchmarks small-m-products [MODEL] [--ms 1,2,4,8] [--repeats 7]

The weight is MODEL's (a `metrale_jax.model_registry.config` name, default qwen3-next-h512) gate/up rows of all
experts, as the `anatomy` section's product sweep takes it. Every call reads another of enough distinct weights that
their total is past any cache (`anatomy.OUT_OF_CACHE_BYTES`), so the figures are a real step's regime. Per M: ms per
product (median over the repeats), GB/s of weight read, each against the same side's first M, and the largest
difference from XLA's result relative to its largest value. The kernel is called directly (`api._kernel`), also at
row counts the engine leaves to XLA (`api.ROWS_MIN`, `api.ROWS_MAX`). Pinned to one core.

NOTE: the kernel holds the accumulators of at most 8 rows in registers; past 8 rows it reads the weight again for
each further group of 8, so its time per row falls less beyond 8 (the engine stops at ROWS_MAX, the most rows
measured quicker than XLA's dot in the engine's verify).
"""

import statistics
import time

import click
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.anatomy import OUT_OF_CACHE_BYTES
from kernels_cpu.rows_matmul import api
from kernels_cpu.rows_matmul.reference import rows_matmul_reference
from metrale_jax.model_registry import config
from metrale_jax.text_table import text_table


def _seconds(prod, x, weights: list) -> float:
    t0 = time.perf_counter()
    for w in weights:
        y = prod(x, w)
    y.block_until_ready()
    return (time.perf_counter() - t0) / len(weights)


@click.command("small-m-products", help="XLA's products of a few rows vs the CPU rows kernel, weights out of cache.")
@click.argument("model", default="qwen3-next-h512")
@click.option("--ms", default="1,2,4,8", help="row counts M")
@click.option("--repeats", default=7, help="sweeps per M and side (median)")
def command(model: str, ms: str, repeats: int) -> None:
    reason = api._registered()
    if reason is not None:
        raise click.ClickException(f"the rows kernel is not available: {reason}")
    cfg = config(model)
    out_dim, in_dim = cfg.num_experts * 2 * cfg.moe_intermediate_size, cfg.hidden_size
    per = out_dim * in_dim * 4
    count = max(2, OUT_OF_CACHE_BYTES // per)
    keys = jax.random.split(jax.random.key(0), count)
    weights = [jax.random.normal(k, (in_dim, out_dim), jnp.float32) for k in keys]  # input-major [in, out]
    sides = {"xla": jax.jit(rows_matmul_reference), "kernel": jax.jit(api._kernel)}
    rows = []
    for m in [int(v) for v in ms.split(",")]:
        x = jax.random.normal(jax.random.key(m), (m, in_dim), jnp.float32)
        ref = np.asarray(sides["xla"](x, weights[0]))
        err = float(np.abs(np.asarray(sides["kernel"](x, weights[0])) - ref).max() / np.abs(ref).max())
        times: dict[str, list[float]] = {side: [] for side in sides}
        for r in range(repeats):
            for side in sides if r % 2 == 0 else reversed(sides):
                times[side].append(_seconds(sides[side], x, weights))
        rows.append((m, statistics.median(times["xla"]), statistics.median(times["kernel"]), err))
    print(
        f"{model}: x [M, {in_dim}] @ w [{in_dim}, {out_dim}] float32, {count} distinct weights of "
        f"{per / 2**20:.1f} MiB, one core, median of {repeats}; jax {jax.__version__}"
    )
    base_x, base_k = rows[0][1], rows[0][2]
    cells = [
        (
            m,
            f"{1e3 * tx:.3f}",
            f"{per / tx / 1e9:.1f}",
            f"{tx / base_x:.2f}",
            f"{1e3 * tk:.3f}",
            f"{per / tk / 1e9:.1f}",
            f"{tk / base_k:.2f}",
            f"{tx / tk:.2f}",
            f"{err:.1e}",
        )
        for m, tx, tk, err in rows
    ]
    headers = ("M", "XLA ms", "GB/s", "x first M", "kernel ms", "GB/s", "x first M", "XLA/kernel", "max rel diff")
    print("\n".join(text_table(headers, cells, right=range(len(headers)))))
