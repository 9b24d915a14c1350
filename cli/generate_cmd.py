"""`metrale-jax generate`: greedy text generation on the engine, plain or with the MTP drafter: the
text, what the drafter did (acceptance by draft position, tokens per verify), and where the time
went (compiling, then the steady state).

Owns only argument handling, the request's up-front checks and printing; the decoding is
`metrale_jax.engine.speculative`, the statistics `metrale_jax.research.ScheduleRun`, the text
`metrale_jax.tokenizer`, the progress bar `metrale_jax.diff.progress.Bar`.

Invariants:
- The printed continuation is the same with and without `--speculative`, with the fused or the
  composed step (greedy).
- Every user error prints `error: ...` lines on stderr and exits 2. A request that cannot fit is
  refused before the engine allocates: a `--max-seq-len` under what the request reaches, or an
  engine pool (the planner's `serve_pools`: its exact buffers) over what the device can still
  hold (`require_room`).
- A request the engine would quietly reduce says so: drafts over what the K ladder gives one
  active sequence are clamped, the engine is built for the clamped count, and a `note:` line
  states it.
- The engine compiles the programs this generation runs before its first step (`Engine.warm_up`
  with `program_list.generation_programs`, a progress section of its own): the warm-up seconds
  are reported apart, and so is the count of programs compiled after it (0 unless a step ran a
  program the list missed). Steady-state tokens/s is `metrale_jax.engine.throughput`'s (the steps
  after the prefill that compiled no program); the compile seconds are the engine's
  `ProgramCache.compile_seconds` (summed over programs compiled side by side).
Defaults differing from a serve (each overridable by its flag): one slot (`--max-batch-size 1`),
`--max-seq-len` just covering what the request reaches, `--kv-cache-dtype f32`.
"""

from __future__ import annotations

import math
import os
import time

import click

from metrale_jax.diff.progress import Bar
from metrale_jax.engine.capacity import ladder_drafts
from metrale_jax.engine.engine import Engine
from metrale_jax.engine.program_list import generation_programs
from metrale_jax.engine.settings import format_k_ladder, resolve_settings
from metrale_jax.engine.sharding import make_mesh
from metrale_jax.engine.speculative import DraftSchedule, greedy_generate, speculative_generate
from metrale_jax.engine.throughput import StepClock
from metrale_jax.memory.plan import require_room, serve_pools
from metrale_jax.model.fp8_linear import refuse_on_mesh
from metrale_jax.presets import resolve_checkpoint
from metrale_jax.presets_data import PRESET_DIRS
from metrale_jax.research import ScheduleRun
from metrale_jax.tokenizer import tokenizer_for
from metrale_jax_cli.errors import UsageError, user_errors
from metrale_jax_cli.serve_flags import pop_serve_raw, serve_options


def _acceptance_lines(run: ScheduleRun) -> list[str]:
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


def tokens_reached(prompt_tokens: int, max_new_tokens: int, drafts: int) -> int:
    """The longest a generation's sequence gets, in KV positions: the prompt, the output and, with
    drafts, a verify's K = drafts + 1 rows past the last committed token plus the next propose's
    drafts (the engine reserves both before it runs them; 0 drafts = plain greedy)."""
    return prompt_tokens + max_new_tokens + 2 * drafts


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
@click.option(
    "--step",
    type=click.Choice(["fused", "composed"]),
    help="With --speculative: one program per scheduler step (fused; the default under snapshot rollback) or "
    "the composed transitions (the default under replay rollback).",
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16"]),
    help="Weight/activation dtype [the checkpoint's own: config.json's dtype; presets float32].",
)
@serve_options
@click.pass_context
@user_errors
def generate(ctx, checkpoint, prompt, max_new_tokens, confidence_stop, step, dtype, **kwargs):
    """Continue PROMPT greedily and print the text; with --speculative (e.g. --num-drafts 3) the
    MTP head drafts and each verify checks its drafts, and the acceptance statistics follow."""
    raw = pop_serve_raw(ctx, kwargs)
    directory = PRESET_DIRS.get(checkpoint, checkpoint if os.path.isdir(checkpoint) else None)
    cfg, params = resolve_checkpoint(directory or checkpoint, dtype)
    tok = tokenizer_for(directory, cfg.vocab_size)
    ids = tok.encode(prompt)
    if not ids:
        raise UsageError("--prompt is empty")
    raw.setdefault("max_batch_size", "1")
    raw.setdefault("kv_cache_dtype", "f32")
    asked = resolve_settings(raw, None, auto_slots=1)
    if confidence_stop is not None and not asked.speculative:
        raise UsageError("--confidence-stop needs --speculative")
    if step is not None and not asked.speculative:
        raise UsageError(f"--step {step} needs --speculative")
    if step == "fused" and asked.ssm_rollback_mode == "replay":
        raise UsageError("--step fused needs --ssm-rollback-mode snapshot (the fused step is write-on-accept only)")
    step = step or ("composed" if asked.ssm_rollback_mode == "replay" else "fused")
    drafts = ladder_drafts(1, asked.num_drafts, asked.k_ladder) if asked.speculative else 0
    note = None
    if asked.speculative and drafts < asked.num_drafts:
        raw["num_drafts"] = drafts
        ladder = format_k_ladder(asked.k_ladder)
        note = (
            f"note: --num-drafts {asked.num_drafts} clamped to {drafts}: the K ladder {ladder} drafts at most "
            f"{drafts} at 1 active sequence (--mtp-k-ladder 1:{asked.num_drafts} lifts it)"
        )
    reached = tokens_reached(len(ids), max_new_tokens, drafts)
    if "max_seq_len" in raw and raw["max_seq_len"] < reached:
        raise UsageError(
            f"--max-seq-len {raw['max_seq_len']} is under the {reached} tokens this request reaches "
            f"({len(ids)} prompt + {max_new_tokens} new"
            + (f" + 2 x {drafts}: a verify's and the next propose's drafts)" if drafts else ")")
        )
    raw.setdefault("max_seq_len", 16 * math.ceil(reached / 16))
    settings = resolve_settings(raw, None, auto_slots=1)
    mesh = make_mesh(cfg, settings.tensor_parallel_size, settings.expert_parallel_size)
    refuse_on_mesh(params, mesh)
    require_room(
        f"the engine pool for {len(ids)} prompt + {max_new_tokens} new tokens"
        + (f" with {drafts} drafts" if drafts else "")
        + f" (max_seq_len {settings.max_seq_len})",
        serve_pools(cfg, settings, params["embed"].dtype),
        "ask for fewer tokens" + (" or drafts" if drafts else ""),
    )
    engine = Engine(cfg, params, settings, mesh=mesh)
    bar = Bar()
    t0 = time.perf_counter()
    run = None
    try:
        path = step if settings.speculative else "greedy"
        warm_seconds = engine.warm_up(bar, generation_programs(engine.counts, [len(ids)], path))
        warmed = engine.programs.compilations
        bar.section("generate", max_new_tokens)
        clock = StepClock(engine.programs, bar.advance)
        if settings.speculative:
            schedule = DraftSchedule(settings.num_drafts, settings.k_ladder, confidence_stop)
            res = speculative_generate(engine, [ids], max_new_tokens, schedule, fused=step == "fused", progress=clock)
            run = ScheduleRun.from_generations(schedule, 1, max_new_tokens, [([0], res)])
            out = res.tokens[0]
        else:
            out = greedy_generate(engine, [ids], max_new_tokens, progress=clock)[0]
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    mode = (
        f"speculative, {step} step, up to {settings.num_drafts} MTP draft(s) per verify"
        if run
        else "plain greedy; add --speculative --num-drafts 3 to see the drafter"
    )
    click.echo(f"{checkpoint}: {len(ids)} prompt tokens, {len(out)} generated ({mode})")
    if note:
        click.echo(note)
    click.echo(tok.decode(ids) + click.style(tok.decode(out), bold=True))
    click.echo("")
    for line in _acceptance_lines(run) if run else [f"decode steps: {len(out) - 1} after the prefill"]:
        click.echo(line)
    click.echo(
        f"time: {seconds:.2f} s wall, {engine.programs.compile_seconds:.2f} s of it compiling "
        f"{engine.programs.compilations} programs ({warm_seconds:.2f} s warm-up; "
        f"{engine.programs.compilations - warmed} programs compiled after it)"
    )
    click.echo(clock.line())
