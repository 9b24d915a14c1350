"""The `gap` section: the engine's verify step after idle gaps before each call, the cost the call-by-call
timing of `hf` charges the side that waits longer (runner: `benchmarks.idle_gap`).
"""

from __future__ import annotations

from typing import Any

import click

from benchmarks.report import Grid, Table
from benchmarks.settings import STEP_OPTIONS, Command, Options, Preset, Settings, ints

COMMANDS: dict[str, Command] = {
    "gap": (
        "the engine's verify step after idle gaps before each call",
        (
            click.Option(["--gaps-ms"], callback=ints, help="idle gaps before each verify, default 0,2,8 (smoke 0,1)"),
            click.Option(["--gap-calls"], type=int, help="timed calls per gap and round, default 40 (smoke 2)"),
            click.Option(["--gap-rounds"], type=int, help="rounds over the gaps, default 3 (smoke 1)"),
            *(STEP_OPTIONS[k] for k in ("model", "ns", "ks", "ctx", "warmup")),
        ),
    )
}


def resolve(a: Options, p: Preset) -> dict[str, Any]:
    """The gap fields of `Settings` beyond the step shape."""
    return dict(
        gaps_ms=p.pick(a.get("gaps_ms"), [0, 2, 8], [0, 1]),
        gap_calls=p.pick(a.get("gap_calls"), 40, 2),
        gap_rounds=p.pick(a.get("gap_rounds"), 3, 1),
    )


def run(name: str, s: Settings) -> dict:
    from benchmarks import idle_gap

    return idle_gap.run(s)


def table(r: dict) -> Table:
    base = r["gaps"][0]["best_median_s"]
    rows = [
        (
            f"{1e3 * g['gap_s']:.0f}",
            f"{1e3 * g['best_median_s']:.3f}",
            f"{g['best_median_s'] / base:.2f}",
            " ".join(f"{1e3 * x:.3f}" for x in g["round_medians_s"]),
        )
        for g in r["gaps"]
    ]
    return Table(
        f"Idle gap before a call: the engine's verify step (n={r['n']}, K={r['k']}, context "
        f"{r['context_tokens']} tokens, model {r['model']}), {r['calls']} calls per gap and round, best of "
        f"{r['rounds']} round medians",
        grids=(Grid(("gap ms", "ms", "x first", "round medians ms"), rows, left=(3,)),),
    )
