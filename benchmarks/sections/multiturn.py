"""The `multiturn` section: conversations sharing a system prompt and their own history, with and without the
prefix cache: prompt tokens, tokens prefilled, hit rate, time to first token per turn (runner:
`benchmarks.multiturn`).
"""

from __future__ import annotations

from typing import Any

import click

from benchmarks.report import Grid, Table
from benchmarks.settings import Command, Options, Preset, Settings

COMMANDS: dict[str, Command] = {
    "multiturn": (
        "multi-turn conversations with and without the prefix cache: tokens prefilled, hit rate, TTFT",
        (
            click.Option(["--multiturn-model"], help="the model (default qwen3-next-h512; smoke tiny-2L)"),
            click.Option(["--multiturn-conversations"], type=int, help="conversations (default 4; smoke 2)"),
            click.Option(["--multiturn-turns"], type=int, help="turns per conversation (default 4; smoke 2)"),
        ),
    )
}


def resolve(a: Options, p: Preset) -> dict[str, Any]:
    """The multiturn fields of `Settings` (absent options take the preset's sizes)."""
    return dict(
        multiturn_model=p.pick(a.get("multiturn_model"), "qwen3-next-h512", "tiny-2L"),
        multiturn_conversations=p.pick(a.get("multiturn_conversations"), 4, 2),
        multiturn_turns=p.pick(a.get("multiturn_turns"), 4, 2),
        multiturn_system_len=p.pick(None, 384, 40),
        multiturn_user_len=p.pick(None, 48, 9),
        multiturn_new_tokens=p.pick(None, 16, 4),
        multiturn_block=16,
        multiturn_chunk=p.pick(None, 256, 32),
    )


def run(name: str, s: Settings) -> dict:
    from benchmarks import multiturn

    return multiturn.run(s)


def table(r: dict) -> Table:
    modes = r["modes"]
    turns = len(modes["cached"]["ttft_median_s"])
    rows = [
        (
            name,
            str(m["prompt_tokens"]),
            str(m["prefill_tokens"]),
            f"{100 * m['saved']:.0f}%",
            f"{100 * m['hit_rate']:.0f}%",
            " ".join(f"{1e3 * x:.1f}" for x in m["ttft_median_s"]),
            f"{m['ttft_total_s']:.2f}",
        )
        for name, m in modes.items()
    ]
    headers = (
        "prefix cache",
        "prompt tok",
        "prefilled tok",
        "saved",
        "hit rate",
        f"TTFT ms, turns 1..{turns}",
        "TTFT s",
    )
    return Table(
        f"Multi-turn: {r['conversations']} conversations x {r['turns']} turns (system prompt {r['system_len']}, "
        f"user {r['user_len']}, {r['new_tokens']} generated per turn; block {r['block_size']}, prefill chunk "
        f"{r['prefill_chunk']}), model {r['model']}; TTFT = a turn's prefill, median per turn index; same tokens "
        f"with and without the cache: {'yes' if r['same_tokens'] else 'NO'}",
        grids=(Grid(headers, rows, left=(0,)),),
    )
