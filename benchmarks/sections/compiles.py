"""The `compile` section: time to first step and compilations of a ragged verify loop, the tiny model and the
48-layer Qwen3-Next pattern at tiny width, scan layout against unrolled (runner: `benchmarks.compile_cost`).
"""

from __future__ import annotations

from typing import Any

import click

from benchmarks.report import Grid, Table, log, median_range
from benchmarks.settings import Command, Options, Preset, Settings, strs

COMMANDS: dict[str, Command] = {
    "compile": (
        "time to first step and compilations of a ragged verify loop, scan vs unrolled layout",
        (
            click.Option(
                ["--compile-models"], callback=strs, help="default tiny,qwen3-next-48L (smoke: qwen3-next-4L-i2)"
            ),
            click.Option(["--compile-steps"], type=int, help="verify-loop steps, default 50"),
            click.Option(["--compile-repeats"], type=int, help="runs per case, default 2"),
            click.Option(["--no-isolate"], is_flag=True, default=None, help="measure the cases in this process"),
        ),
    )
}


def resolve(a: Options, p: Preset) -> dict[str, Any]:
    """The compile fields of `Settings` (absent options take the preset's sizes; smoke runs in-process)."""
    return dict(
        compile_models=p.pick(a.get("compile_models"), ["tiny", "qwen3-next-48L"], ["qwen3-next-4L-i2"]),
        compile_steps=p.pick(a.get("compile_steps"), 50, 5),
        compile_repeats=p.pick(a.get("compile_repeats"), 2, 1),
        isolate=not (a.get("no_isolate") or p.smoke),
    )


def run(name: str, s: Settings) -> dict:
    from benchmarks import compile_cost

    return compile_cost.run(s, log=log)


def table(r: dict) -> Table:
    rows = []
    for c in r["cases"]:
        sr = c["program_compile_s"].get("step_rows", {"median": float("nan")})
        rows.append(
            (
                c["model"],
                str(c["layers"]),
                str(c["groups"]),
                c["layout"] if c["groups"] > 1 else "one group",
                f"{c['engine_init_s']['median']:.1f}",
                median_range(c["time_to_first_step_s"], 1, ".1f"),
                f"{c['prefill_first_s']['median']:.1f}",
                f"{c['first_step_s']['median']:.1f}",
                f"{sr['median']:.1f}",
                f"{c['steady_step_ms']:.1f}",
                "/".join(str(x) for x in c["compilations"]),
                str(c["recompiles_after_warmup"] + c["backend_compiles_after_warmup"]),
            )
        )
    headers = (
        "model",
        "layers",
        "groups",
        "layout",
        "init",
        "time to first step",
        "prefill 1st",
        "loop step 1",
        "verify compile",
        "steady ms",
        "compiles",
        "after warm-up",
    )
    footer = []
    by = {(c["model"], c["layout"]): c for c in r["cases"]}
    for (m, layout), c in by.items():
        if layout == "scan" and (m, "unrolled") in by:
            u = by[(m, "unrolled")]
            first = u["time_to_first_step_s"]["median"] / c["time_to_first_step_s"]["median"]
            compiles = ", ".join(
                f"{p} compile {u['program_compile_s'][p]['median']:.1f} s -> "
                f"{c['program_compile_s'][p]['median']:.1f} s"
                for p in ("prefill_chunk", "step_rows", "propose")
                if p in c["program_compile_s"] and p in u["program_compile_s"]
            )
            footer.append(f"{m}: unrolled/scan time to first step {first:.2f}x; {compiles}")
    isolated = ", each in a fresh process" if r["isolated"] else ""
    return Table(
        f"Compile cost: {r['steps']}-step ragged verify loop (propose, verify K in {{1..4}} ragged, stash, fold, "
        f"commit), {r['repeats']} run(s) each{isolated}; seconds: median (min-max)",
        notes=(
            "time to first step = the engine's first prefill + the loop's first step (engine construction apart: "
            "'init')",
        ),
        grids=(Grid(headers, rows, left=(0, 3)),),
        footer=footer,
    )
