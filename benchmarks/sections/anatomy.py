"""The `anatomy` section: where a step's time goes, the programs a generation step runs (launches, device
time alone) and this core's matrix products at a step's row counts (runner: `benchmarks.anatomy`).
"""

from __future__ import annotations

from typing import Any

from benchmarks.report import Grid, Table
from benchmarks.settings import Command, Options, Preset, Settings

COMMANDS: dict[str, Command] = {
    "anatomy": ("the programs a generation step runs on small, and this core's products at a step's row counts", ()),
}


def resolve(a: Options, p: Preset) -> dict[str, Any]:
    """The anatomy fields of `Settings` (the preset's sizes)."""
    return dict(
        anatomy_model=p.pick(None, "small", "tiny"),
        anatomy_dot_model=p.pick(None, "qwen3-next-h512", "tiny"),
        anatomy_drafts=p.pick(None, [1, 2, 3], [1]),
        anatomy_iters=p.pick(None, 50, 2),
        anatomy_ms=p.pick(None, [1, 2, 4, 8, 16, 32], [1, 8]),
        anatomy_repeats=p.pick(None, 3, 1),
    )


def run(name: str, s: Settings) -> dict:
    from benchmarks import anatomy

    return anatomy.run(s)


def table(r: dict) -> Table:
    programs = [
        (
            p["engine"],
            p["step"],
            p["program"],
            str(p["launches"]),
            f"{1e3 * p['device_s']:.3f}",
            f"{p['us_per_launch']:.2f}",
        )
        for p in r["programs"]
    ]
    dots = [
        (
            d["layout"],
            str(d["m"]),
            f"{1e3 * d['cold_s']:.3f}",
            f"{d['cold_gb_s']:.1f}",
            f"{1e3 * d['warm_s']:.3f}",
            f"{d['warm_gb_s']:.1f}",
        )
        for d in r["dots"]
    ]
    out_dim, in_dim = r["dot_shape"]
    return Table(
        f"Anatomy of a step: the programs a generation step runs on {r['model']}, and this core's matrix products "
        f"at a step's row counts ({r['dot_model']}'s expert gate/up rows, [{out_dim}, {in_dim}] float32)",
        notes=(
            "launches: top-level kernels of the program's entry computation (ProgramInfo.launches); device ms: the "
            "compiled program alone on its captured arguments, median (pool donated and fed back); us/launch = the two",
            "products: linear(x [M, in], w), w in the checkpoint's [out, in] layout and input-major [in, out] "
            "(linear.TransposedWeight, what the single-device CPU engine runs); 'from memory': a different weight each "
            "call (their total past any cache, as in a real step), 'in cache': one weight re-read; GB/s of weight read "
            "per call",
        ),
        grids=(
            Grid(("engine", "step", "program", "launches", "device ms", "us/launch"), programs, left=(0, 1, 2)),
            Grid(("weight", "M", "from memory ms", "GB/s", "in cache ms", "GB/s "), dots),
        ),
    )
