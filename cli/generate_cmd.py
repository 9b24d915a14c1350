"""`metrale-jax generate`: greedy text generation on the engine, plain or with the MTP drafter: the
text, what the drafter did (acceptance by draft position, tokens per verify), and where the time
went (compiling, then the steady state).

Owns only argument handling, the request's up-front checks and printing; the decoding is
`metrale_jax.engine.speculative`, the statistics `metrale_jax.research.ScheduleRun`, the text
`metrale_jax.tokenizer`, the progress bar `metrale_jax.diff.progress.Bar`.

Invariants:
- The printed continuation is the same with and without `--speculative`, with the fused or the
  composed step, greedy or sampled with a `--seed` (gumbel speculative sampling, the default
  `--speculative-sampling`); under `--speculative-sampling rejection` a sampled speculative run
  follows plain sampling's law, not its tokens. The sampling flags are `sampling_flags`'.
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
- Text in, text out through the checkpoint's own tokenizer (`metrale_jax.tokenizer`), checked
  before the weights are read: a tokenizer file that cannot be used, a prompt its vocabulary
  cannot encode, a chat template that fails to render (`--chat`) are refused first. `--chat`
  renders [`--system`, the prompt] with the checkpoint's chat template and a generation prompt,
  as transformers' `apply_chat_template` (its ids encoded without added special tokens, as there).
- Generation ends at the checkpoint's EOS ids (`stop_ids`: generation_config.json, else
  config.json), the EOS token kept, as HF's `generate` does; presets declare none.
Defaults differing from a serve (each overridable by its flag): one slot (`--max-batch-size 1`),
`--max-seq-len` just covering what the request reaches, `--kv-cache-dtype f32`.
"""

from __future__ import annotations

import math
import time
from typing import Any

import click

from metrale_jax.chat_template import chat_messages, load_chat_template
from metrale_jax.config import load_model_config
from metrale_jax.diff.progress import Bar
from metrale_jax.engine.capacity import ladder_drafts
from metrale_jax.engine.engine import Engine
from metrale_jax.engine.program_list import generation_programs
from metrale_jax.engine.settings import format_k_ladder, resolve_settings
from metrale_jax.engine.sharding import check_fp8_blocks, make_mesh, mesh_sizes
from metrale_jax.engine.speculative import DraftSchedule, greedy_generate, speculative_generate
from metrale_jax.engine.throughput import StepClock
from metrale_jax.hub_cache import checkpoint_directory
from metrale_jax.memory.plan import require_room, serve_pools
from metrale_jax.presets import PRESETS, resolve_checkpoint
from metrale_jax.research import ScheduleRun
from metrale_jax.tokenizer import HFTokenizer, Tokenizer, stop_ids, tokenizer_for
from metrale_jax_cli.errors import UsageError, user_errors
from metrale_jax_cli.sampling_flags import parse_sampling, sampling_options
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


def prompt_ids(
    directory: str | None, vocab_size: int, prompt: str, chat: bool, system: str | None, thinking: bool | None
) -> tuple[Tokenizer, list[int]]:
    """The checkpoint's tokenizer and the ids of the request: `prompt` as text, or with `chat` the
    rendered conversation [system, prompt] ending in a generation prompt (`thinking` sets the
    template's `enable_thinking` when not None). Reads only text files. Raises MetraleError."""
    tok = tokenizer_for(directory, vocab_size)
    if not chat:
        return tok, tok.encode(prompt)
    if directory is None:
        raise UsageError("--chat needs a checkpoint directory with a chat template (a preset has none)")
    variables: dict[str, Any] = {} if thinking is None else {"enable_thinking": thinking}
    text = load_chat_template(directory).render(chat_messages(prompt, system), add_generation_prompt=True, **variables)
    return tok, tok.encode(text, add_special_tokens=False) if isinstance(tok, HFTokenizer) else tok.encode(text)


def tokens_reached(prompt_tokens: int, max_new_tokens: int, drafts: int) -> int:
    """The longest a generation's sequence gets, in KV positions: the prompt, the output and, with
    drafts, a verify's K = drafts + 1 rows past the last committed token plus the next propose's
    drafts (the engine reserves both before it runs them; 0 drafts = plain greedy)."""
    return prompt_tokens + max_new_tokens + 2 * drafts


@click.command("generate")
@click.option("--checkpoint", required=True, help="Preset (tiny, small) or checkpoint directory.")
@click.option("--prompt", required=True, help="Prompt text, encoded with the checkpoint's tokenizer.")
@click.option("--chat", is_flag=True, help="Send the prompt as a user turn through the checkpoint's chat template.")
@click.option("--system", help="With --chat: a system turn before the prompt.")
@click.option(
    "--thinking/--no-thinking",
    default=None,
    help="With --chat: set the template's enable_thinking (default: the template's own default).",
)
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
@sampling_options
@serve_options
@click.pass_context
@user_errors
def generate(
    ctx,
    checkpoint,
    prompt,
    chat,
    system,
    thinking,
    max_new_tokens,
    confidence_stop,
    step,
    dtype,
    temperature,
    top_k,
    top_p,
    min_p,
    seed,
    **kwargs,
):
    """Continue PROMPT greedily (or sampled: --temperature, --seed) and print the text; with
    --speculative (e.g. --num-drafts 3) the MTP head drafts and each verify checks its drafts
    (sampled: gumbel speculative sampling, the same tokens as plain sampling with the seed; or
    --speculative-sampling rejection, plain sampling's law), and the acceptance statistics follow."""
    sampling = parse_sampling(temperature, top_k, top_p, min_p, seed)
    raw = pop_serve_raw(ctx, kwargs)
    if (system is not None or thinking is not None) and not chat:
        raise UsageError(("--system" if system is not None else "--thinking/--no-thinking") + " needs --chat")
    directory = checkpoint_directory(checkpoint)
    if directory is None and checkpoint not in PRESETS:
        resolve_checkpoint(checkpoint)  # raises the one line naming what --checkpoint may be
    vocab_size = PRESETS[checkpoint][0].vocab_size if directory is None else load_model_config(directory).vocab_size
    tok, ids = prompt_ids(directory, vocab_size, prompt, chat, system, thinking)
    stops = stop_ids(directory)
    if not ids:
        raise UsageError("--prompt is empty")
    cfg, params = resolve_checkpoint(directory or checkpoint, dtype)
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
    check_fp8_blocks(params, cfg, mesh_sizes(mesh)[0])
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
        keep = generation_programs(engine.counts, [len(ids)], path)
        warm_seconds = engine.warm_up(bar, keep, samples=sampling is not None)
        warmed = engine.programs.compilations
        bar.section("generate", max_new_tokens)
        clock = StepClock(engine.programs, bar.advance)
        if settings.speculative:
            schedule = DraftSchedule(settings.num_drafts, settings.k_ladder, confidence_stop)
            res = speculative_generate(
                engine,
                [ids],
                max_new_tokens,
                schedule,
                fused=step == "fused",
                progress=clock,
                sampling=sampling,
                stop_ids=stops,
            )
            run = ScheduleRun.from_generations(schedule, 1, max_new_tokens, [([0], res)])
            out = res.tokens[0]
        else:
            out = greedy_generate(engine, [ids], max_new_tokens, progress=clock, sampling=sampling, stop_ids=stops)[0]
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    how = "" if sampling is None else f", sampled: {sampling.describe()}"
    mode = (
        f"speculative, {step} step, up to {settings.num_drafts} MTP draft(s) per verify{how}"
        + ("" if sampling is None else f", {settings.speculative_sampling} acceptance")
        if run
        else f"plain {'greedy' if sampling is None else 'sampling'}{how}; add --speculative --num-drafts 3 to see "
        "the drafter"
    )
    ended = " (ended at EOS)" if out and out[-1] in stops else ""
    click.echo(f"{checkpoint}: {len(ids)} prompt tokens, {len(out)} generated{ended} ({mode})")
    if note:
        click.echo(note)
    click.echo(tok.decode(ids) + click.style(tok.decode(out), bold=True))
    click.echo("")
    for line in _acceptance_lines(run) if run else [f"decode steps: {len(out) - 1} after the prefill"]:
        click.echo(line)
    click.echo(
        f"time: {seconds:.2f} s wall ({warm_seconds:.2f} s warm-up); {engine.programs.compilations} programs "
        f"compiled, {engine.programs.compile_seconds:.2f} s summed over them (the warm-up compiles in parallel); "
        f"{engine.programs.compilations - warmed} compiled after the warm-up"
    )
    click.echo(clock.line())
