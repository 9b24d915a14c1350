"""The `invariant` section: the engine's decode, verify and prefill steps under --batch-invariant against the
default mode, side by side in one run (runner: `benchmarks.batch_invariant_steps`).
"""

from __future__ import annotations

from typing import Any

import click

from benchmarks.report import Grid, Table
from benchmarks.settings import STEP_OPTIONS, Command, Options, Preset, Settings, strs

COMMANDS: dict[str, Command] = {
    "invariant": (
        "the batch-invariant mode's step times against the default mode's",
        (
            click.Option(["--invariant-models"], callback=strs, help="default tiny,small,qwen3-next-h512 (smoke tiny)"),
            click.Option(
                ["--invariant-prefill"],
                type=int,
                help="prefill tokens (one chunk, once a round), default 256 (smoke 32)",
            ),
            click.Option(["--invariant-rounds"], type=int, help="alternated rounds of both modes, default 3 (smoke 1)"),
            click.Option(
                ["--invariant-calls"],
                type=int,
                help="calls of each step per round (at least; a fast step more), default 5 (smoke 1)",
            ),
            STEP_OPTIONS["ctx"],
        ),
    )
}


def resolve(a: Options, p: Preset) -> dict[str, Any]:
    """The invariant fields of `Settings`."""
    return dict(
        invariant_models=p.pick(a.get("invariant_models"), ["tiny", "small", "qwen3-next-h512"], ["tiny"]),
        invariant_prefill=p.pick(a.get("invariant_prefill"), 256, 32),
        invariant_rounds=p.pick(a.get("invariant_rounds"), 3, 1),
        invariant_calls=p.pick(a.get("invariant_calls"), 5, 1),
    )


def run(name: str, s: Settings) -> dict:
    from benchmarks import batch_invariant_steps

    return batch_invariant_steps.run(s)


def table(r: dict) -> Table:
    rows = [
        (
            row["model"],
            row["step"],
            f"{1e3 * row['default_s']:.3f}",
            f"{1e3 * row['invariant_s']:.3f}",
            f"{row['ratio']:.2f}",
            " ".join(f"{x:.2f}" for x in row["round_ratios"]),
        )
        for row in r["rows"]
    ]
    headers = ("model", "step", "default ms", "invariant ms", "x default", "round ratios")
    return Table(
        f"Batch-invariant mode: engine steps under --batch-invariant against the default mode (context "
        f"{r['context_tokens']} tokens), each mode in its own process, {r['rounds']} alternated rounds of "
        f"{r['calls']} calls; median of round medians, ratio the median of the rounds' ratios",
        grids=(Grid(headers, rows, left=(0, 1)),),
    )
