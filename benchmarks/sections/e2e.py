"""The `e2e` section: steady-state tokens/s of speculative against plain greedy generation, in one run: `small`
with its MTP head drafting, and a realistic-width model with oracle drafts (runner: `benchmarks.e2e`).
"""

from __future__ import annotations

from typing import Any

import click

from benchmarks.report import Grid, Table, median_range, quartiles
from benchmarks.settings import Command, Options, Preset, Settings, ints

COMMANDS: dict[str, Command] = {
    "e2e": (
        "steady-state tokens/s, speculative vs greedy: small with its MTP drafts, the 45 M width with oracle drafts",
        (
            click.Option(["--e2e-ns"], callback=ints, help="prompts generated together on small, default 1,4,8"),
            click.Option(["--e2e-drafts"], callback=ints, help="drafts per verify on small, default 1,2,3"),
            click.Option(["--e2e-new-tokens"], type=int, help="tokens per prompt on small, default 96"),
            click.Option(["--e2e-oracle-model"], help="the model run with oracle drafts, default qwen3-next-h512"),
            click.Option(
                ["--e2e-oracle-ns"],
                callback=ints,
                help="prompts generated together, oracle drafts, default 1,8",
            ),
            click.Option(["--e2e-oracle-new-tokens"], type=int, help="tokens per prompt, oracle drafts, default 48"),
            click.Option(["--e2e-accept"], type=float, help="the oracle's chance a draft is right, default 0.8"),
            click.Option(["--e2e-rounds"], type=int, help="timed rounds, default 3"),
            click.Option(
                ["--e2e-sample-ns"],
                callback=ints,
                help="prompts generated together on small, sampled (gumbel mode), default 1,8",
            ),
            click.Option(["--e2e-temperature"], type=float, help="the sampled rows' temperature, default 0.7"),
            click.Option(["--e2e-top-p"], type=float, help="the sampled rows' top-p, default 0.9"),
        ),
    )
}


def resolve(a: Options, p: Preset) -> dict[str, Any]:
    """The e2e fields of `Settings` (absent options take the preset's sizes)."""
    return dict(
        e2e_ns=p.pick(a.get("e2e_ns"), [1, 4, 8], [1]),
        e2e_drafts=p.pick(a.get("e2e_drafts"), [1, 2, 3], [1]),
        e2e_new_tokens=p.pick(a.get("e2e_new_tokens"), 96, 8),
        e2e_prompt_len=p.pick(None, 64, 16),
        e2e_oracle_model=p.pick(a.get("e2e_oracle_model"), "qwen3-next-h512", "tiny-2L"),
        e2e_oracle_ns=p.pick(a.get("e2e_oracle_ns"), [1, 8], [2]),
        e2e_oracle_drafts=p.pick(None, [3], [2]),
        e2e_oracle_new_tokens=p.pick(a.get("e2e_oracle_new_tokens"), 48, 8),
        e2e_accept=p.pick(a.get("e2e_accept"), 0.8, 0.8),
        e2e_rounds=p.pick(a.get("e2e_rounds"), 3, 1),
        e2e_sample_ns=p.pick(a.get("e2e_sample_ns"), [1, 8], [1]),
        e2e_temperature=p.pick(a.get("e2e_temperature"), 0.7, 0.7),
        e2e_top_p=p.pick(a.get("e2e_top_p"), 0.9, 0.9),
    )


def run(name: str, s: Settings) -> dict:
    from benchmarks import e2e

    return e2e.run(s)


def table(r: dict) -> Table:
    rows = []
    for c in r["rows"]:
        drafter = f"oracle p={c['accept']:g}" if c["drafter"] == "oracle" else c["drafter"]
        rows.append(
            (
                c["model"],
                drafter,
                *_speed_cells(c),
                f"{c['tokens_per_verify_per_seq']:.2f}",
                str(c["verify_steps"]),
                "yes" if c["same_tokens"] else "NO",
                f"{c['greedy_first_s']:.1f} / {c['spec_first_s']:.1f}",
            )
        )
    headers = (
        "model",
        "drafts from",
        "n",
        "new",
        "drafts",
        "mode",
        "greedy tok/s",
        "speculative tok/s",
        "spec/greedy",
        "per-round",
        "tokens/verify/seq",
        "verifies",
        "same tokens",
        "1st call s greedy/spec",
    )
    sampled = [_sampled_row(c, r["rows"]) for c in r.get("sampled_rows", [])]
    sampled_headers = (
        "model",
        "sampling",
        "speculative",
        "n",
        "new",
        "drafts",
        "mode",
        "plain tok/s",
        "speculative tok/s",
        "spec/plain",
        "per-round",
        "greedy's spec/greedy",
        "tokens/verify/seq",
        "acceptance by position",
        "same tokens",
    )
    return Table(
        f"End to end: speculative vs plain greedy generation, steady-state tokens/s, {r['rounds']} rounds "
        f"alternated after a warm-up call each; prompts of {r['prompt_len']} tokens",
        notes=(
            "tok/s: median (min-max) over the rounds, from a call's progress report after the prefill to its last "
            "(prefill and compilation excluded; '1st call': the warm-up call, compilation included)",
            "spec/greedy: median (p25-p75) of the per-round ratios; greedy on a non-speculative engine, each draft "
            "count on its own speculative engine (num_drafts = drafts, default K ladder); fused = one program per "
            "scheduler step, composed = verify, stash, fold, commit, propose one by one; oracle = the greedy "
            "continuation replayed, each draft position right with probability p (seeded)",
            "sampled (second grid): gumbel (the MTP drafter drafts with the target's noise; same tokens as plain "
            "sampling) and rejection (the drafter samples its drafts; the same law, not the same tokens: '-') "
            "speculative sampling, fused, against plain sampling on the non-speculative engine, prompt i seeded "
            "seed + i; "
            "greedy's spec/greedy: the first grid's ratio at the same n, drafts and mode; "
            "acceptance: accepted / verified drafts at each "
            "draft position over every call",
        ),
        grids=(
            Grid(headers, rows, left=(0, 1, 5, 12)),
            *([Grid(sampled_headers, sampled, left=(0, 1, 2, 6, 13, 14))] if sampled else []),
        ),
    )


def _speed_cells(c: dict) -> tuple[str, ...]:
    """A row's shape (n, new tokens, drafts, mode) and speeds: plain and speculative tokens/s, their ratio."""
    return (
        str(c["n"]),
        str(c["new_tokens"]),
        str(c["drafts"]),
        c["mode"],
        median_range(c["greedy_tok_s"], 1, ".0f"),
        median_range(c["spec_tok_s"], 1, ".0f"),
        f"{c['ratio']['median']:.2f}x",
        quartiles(c["ratio"]),
    )


def _sampled_row(c: dict, greedy_rows: list[dict]) -> tuple[str, ...]:
    """One sampled row's cells, with greedy's ratio at the same (n, drafts, mode) where the section ran it."""
    same = [
        g
        for g in greedy_rows
        if (g["model"], g["n"], g["drafts"], g["mode"]) == (c["model"], c["n"], c["drafts"], c["mode"])
    ]
    return (
        c["model"],
        c["sampling"],
        c["speculative_sampling"],
        *_speed_cells(c),
        f"{same[0]['ratio']['median']:.2f}x" if same else "-",
        f"{c['tokens_per_verify_per_seq']:.2f}",
        " ".join(f"{a:.2f}" for a in c["acceptance_by_position"]),
        "-" if c["same_tokens"] is None else "yes" if c["same_tokens"] else "NO",
    )
