"""The `forwards` section: the `pallas` forward (the interpreter on CPU) against `xla` on the same engine step
(runner: `benchmarks.forwards`).
"""

from __future__ import annotations

from typing import Any

import click

from benchmarks.report import Grid, Table, median_range, quartiles
from benchmarks.settings import STEP_OPTIONS, Command, Options, Preset, Settings, strs

COMMANDS: dict[str, Command] = {
    "forwards": (
        "the pallas forward (interpreter on CPU) vs xla on the same engine step",
        (
            click.Option(["--forward-steps"], callback=strs, help="steps, default prefill,decode,verify"),
            *(STEP_OPTIONS[k] for k in ("model", "prefill_lens", "ns", "ks", "ctx", "repeats", "warmup")),
        ),
    )
}


def resolve(a: Options, p: Preset) -> dict[str, Any]:
    """The forwards field of `Settings` beyond the step shape."""
    return dict(forward_steps=p.pick(a.get("forward_steps"), ["prefill", "decode", "verify"], ["verify"]))


def run(name: str, s: Settings) -> dict:
    from benchmarks import forwards

    return forwards.run(s)


def table(r: dict) -> Table:
    rows = [
        (
            c["step"],
            str(c["n"]),
            str(c["t"]),
            median_range(c["pallas"]),
            median_range(c["xla"]),
            f"{c['ratio_of_medians']:.2f}",
            quartiles(c["ratio"]),
            f"{c['first_call_s']['pallas']:.1f} / {c['first_call_s']['xla']:.1f}",
            f"{c['max_abs_diff']:.1e}",
        )
        for c in r["cases"]
    ]
    headers = (
        "step",
        "n",
        "T/K",
        "pallas ms",
        "xla ms",
        "pallas/xla",
        "per-round",
        "1st call s pallas/xla",
        "|dlogit|",
    )
    kernels = "interpreter" if r["interpret"] else "compiled kernels"
    footer = ["kernel refusals (ran the reference): " + "; ".join(r["refusals"])] if r["refusals"] else []
    return Table(
        f"Forwards: pallas ({kernels}) vs xla, model {r['model']}, context {r['context_tokens']} tokens; ms: "
        "median (min-max); pallas/xla = ratio of medians (p25-p75 per round)",
        grids=(Grid(headers, rows),),
        footer=footer,
    )
