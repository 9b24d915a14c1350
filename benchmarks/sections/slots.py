"""The `slots` section: a one-sequence step against the engine's slot count, with each engine's pool copies (a
pool copied instead of updated in place grows with the slots) (runner: `benchmarks.slot_scaling`).
"""

from __future__ import annotations

from typing import Any

import click

from benchmarks.report import Grid, Table
from benchmarks.settings import STEP_OPTIONS, Command, Options, Preset, Settings, ints

COMMANDS: dict[str, Command] = {
    "slots": (
        "a one-sequence decode and verify against the engine's slot count",
        (
            click.Option(["--slots-model"], help="default qwen3-next-48L (smoke qwen3-next-4L-i2)"),
            click.Option(["--slot-counts"], callback=ints, help="slot counts (max batch), default 8,64 (smoke 2,8)"),
            click.Option(["--slots-iters"], type=int, help="timed runs per step, default 50 (smoke 2)"),
            *(STEP_OPTIONS[k] for k in ("ks", "ctx")),
        ),
    )
}


def resolve(a: Options, p: Preset) -> dict[str, Any]:
    """The slots fields of `Settings` beyond the step shape."""
    return dict(
        slots_model=p.pick(a.get("slots_model"), "qwen3-next-48L", "qwen3-next-4L-i2"),
        slot_counts=p.pick(a.get("slot_counts"), [8, 64], [2, 8]),
        slots_iters=p.pick(a.get("slots_iters"), 50, 2),
    )


def run(name: str, s: Settings) -> dict:
    from benchmarks import slot_scaling

    return slot_scaling.run(s)


def table(r: dict) -> Table:
    base = r["rows"][0]
    rows = [
        (
            str(row["slots"]),
            f"{row['gdn_state_bytes'] / 1e6:.2f}",
            f"{1e3 * row['decode_s']:.3f}",
            f"{row['decode_s'] / base['decode_s']:.2f}",
            f"{1e3 * row['verify_s']:.3f}",
            f"{row['verify_s'] / base['verify_s']:.2f}",
            str(sum(row["pool_copies"].values())),
        )
        for row in r["rows"]
    ]
    headers = ("slots", "GDN state MB", "decode ms", "x first", "verify ms", "x first", "pool copies")
    return Table(
        f"Slots: one sequence's step (context {r['context_tokens']} tokens, verify K={r['k']}, model "
        f"{r['model']}) against the engine's slot count; compiled programs alone, median of {r['iters']}",
        grids=(Grid(headers, rows, left=()),),
    )
