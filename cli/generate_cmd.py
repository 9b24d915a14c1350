"""`metrale-jax generate`: greedy text generation on the engine, plain or with the MTP drafter, and
what the drafter did (acceptance by draft position, tokens per verify).

Owns only argument handling and printing; the decoding is `metrale_jax.engine.speculative`, the
statistics `metrale_jax.research.Run`, the text `metrale_jax.tokenizer`.

Invariants: the printed continuation is the same with and without `--speculative` (greedy);
every user error prints `error: ...` lines on stderr and exits 2.
Defaults differing from a serve (each overridable by its flag): one slot (`--max-batch-size 1`),
`--max-seq-len` just covering prompt + output (+ drafts), `--kv-cache-dtype f32`.
"""

from __future__ import annotations

import math
import os
import time

import click

from metrale_jax.engine.engine import Engine
from metrale_jax.engine.settings import resolve_settings
from metrale_jax.engine.speculative import DraftSchedule, greedy_generate, speculative_generate
from metrale_jax.presets import resolve_checkpoint
from metrale_jax.presets_data import PRESET_DIRS
from metrale_jax.research import Run
from metrale_jax.tokenizer import tokenizer_for
from metrale_jax_cli.errors import UsageError, user_errors
from metrale_jax_cli.serve_flags import pop_serve_raw, serve_options


def _acceptance_lines(run: Run) -> list[str]:
    s = run.summary()
    lines = [
        f"verify steps: {s['steps']} after the prefill ({s['mean_accepted_length']:.2f} tokens and "
        f"{s['mean_drafted']:.2f} drafts per verify)",
        f"drafts accepted: {run.accepted.sum()}/{run.drafted.sum()}; "
        f"tokens per verify row {s['tokens_per_verify_row']:.2f}",
    ]
    by_pos = [
        f"{j + 1}: {a:.2f} ({int(run.accepted_at[:, j].sum())}/{int((run.drafted > j).sum())})"
        for j, a in enumerate(s["acceptance_by_position"])
        if not math.isnan(a)
    ]
    if by_pos:
        lines.append("acceptance by draft position: " + "  ".join(by_pos))
    return lines


@click.command("generate")
@click.option("--checkpoint", required=True, help="Preset (tiny, small) or checkpoint directory.")
@click.option("--prompt", required=True, help="Prompt text, encoded with the checkpoint's tokenizer.")
@click.option(
    "--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True, help="Tokens to generate (greedy)."
)
@click.option(
    "--confidence-stop",
    type=float,
    help="With --speculative: cut drafts before the first whose log-probability is below this.",
)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@serve_options
@click.pass_context
@user_errors
def generate(ctx, checkpoint, prompt, max_new_tokens, confidence_stop, dtype, **kwargs):
    """Continue PROMPT greedily and print the text; with --speculative (e.g. --num-drafts 3) the
    MTP head drafts and each verify checks its drafts, and the acceptance statistics follow."""
    raw = pop_serve_raw(ctx, kwargs)
    directory = PRESET_DIRS.get(checkpoint, checkpoint if os.path.isdir(checkpoint) else None)
    cfg, params = resolve_checkpoint(directory or checkpoint, dtype)
    tok = tokenizer_for(directory, cfg.vocab_size)
    ids = tok.encode(prompt)
    if not ids:
        raise UsageError("--prompt is empty")
    drafts = int(raw.get("num_drafts") or 1)
    raw.setdefault("max_batch_size", "1")
    raw.setdefault("max_seq_len", 16 * math.ceil((len(ids) + max_new_tokens + drafts + 2) / 16))
    raw.setdefault("kv_cache_dtype", "f32")
    settings = resolve_settings(raw, None, auto_slots=1)
    if confidence_stop is not None and not settings.speculative:
        raise UsageError("--confidence-stop needs --speculative")
    engine = Engine(cfg, params, settings)
    t0 = time.perf_counter()
    run = None
    if settings.speculative:
        schedule = DraftSchedule(settings.num_drafts, settings.k_ladder, confidence_stop)
        res = speculative_generate(engine, [ids], max_new_tokens, schedule)
        run = Run.from_generations(schedule, 1, max_new_tokens, [([0], res)])
        out = res.tokens[0]
    else:
        out = greedy_generate(engine, [ids], max_new_tokens)[0]
    seconds = time.perf_counter() - t0
    mode = (
        f"speculative, up to {settings.num_drafts} MTP draft(s) per verify"
        if run
        else "plain greedy; add --speculative --num-drafts 3 to see the drafter"
    )
    click.echo(f"{checkpoint}: {len(ids)} prompt tokens, {len(out)} generated ({mode})")
    click.echo(tok.decode(ids) + click.style(tok.decode(out), bold=True))
    click.echo("")
    for line in _acceptance_lines(run) if run else [f"decode steps: {len(out) - 1} after the prefill"]:
        click.echo(line)
    click.echo(f"time: {seconds:.2f} s including compilation ({len(out) / seconds:.1f} tokens/s)")
