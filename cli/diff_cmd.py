"""`metrale-jax diff`: forward parity of the engine, byte for byte, with a verdict.

Owns only argument handling: the mode flags into a `DiffRequest`, the serve flags into
`EngineSettings` (as `serve` resolves them), the engine, the variants, then the report to
`--out` and a summary (or the JSON) on stdout. The diff itself is `metrale_jax.diff.run_diff`.

Invariants:
- Exit 0 on PASS, 1 on FAIL, 2 with one `error: ...` line per problem on a bad request (flags,
  checkpoint, settings, an engine that cannot serve the diff, an unwritable `--out`, pools the
  local device cannot hold), 130 on Ctrl-C (`metrale_jax_cli.errors`).
- `--out` is claimed before the engine starts and written atomically once the diff is done: a
  failed or interrupted diff leaves no report and an earlier one untouched.
- A K the engine's slots cannot verify is run at the slot's capacity and says so: a `note:`
  line on stderr and the report's `clamped` list.
- Unless given, `--max-seq-len` is sized to the longest sequence the diff reaches,
  `--max-batch-size` raised to the slots it holds and, for `--prefill`'s cached leg, prefix
  caching turned on; the report's settings table says so.
- Progress goes to stderr only.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import click

from metrale_jax.diff import Bar, DiffRequest, default_variants, render_summary, run_diff, to_json
from metrale_jax.diff.request import CACHED_MIN_TOKENS
from metrale_jax.diff.variants import known_labels
from metrale_jax.engine.capacity import AUTO_MAX_SLOTS
from metrale_jax.engine.engine import Engine
from metrale_jax.engine.sequences import EngineError
from metrale_jax.engine.settings import EngineSettings, option_of, resolve_settings
from metrale_jax.memory.plan import require_room, serve_pools
from metrale_jax.presets import resolve_checkpoint
from metrale_jax_cli.errors import UsageError, user_errors
from metrale_jax_cli.model_toml import load_behavior
from metrale_jax_cli.output import OutputFile
from metrale_jax_cli.sampling_flags import parse_sampling, sampling_options
from metrale_jax_cli.serve_flags import pop_serve_raw, serve_options

SIZED_RULE = "diff: sized to what this diff runs"


def _ints(flag: str, text: str | None) -> tuple[int, ...]:
    """A comma-separated list of integers (None or empty: no list)."""
    if not text:
        return ()
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise UsageError(f"{flag} takes comma-separated integers, got {text!r}") from None


def _settings(checkpoint: str, raw: dict[str, Any], request: DiffRequest) -> EngineSettings:
    """Resolve the serve flags, sizing the context and slots the user left unset."""
    behavior = load_behavior(Path(checkpoint) / "MODEL.toml") if os.path.isdir(checkpoint) else None
    auto = min(request.slots_needed(), AUTO_MAX_SLOTS)
    settings = resolve_settings(raw, behavior, auto_slots=auto)
    request.check_layout(settings.k_ladder)
    needed = request.slots_needed(settings.k_ladder)
    sized: dict[str, int | str] = {}
    if "max_seq_len" not in raw:
        sized["max_seq_len"] = -(-request.tokens_needed(settings.num_drafts) // 64) * 64
    if "max_batch_size" not in raw and settings.max_batch_size < needed:
        sized["max_batch_size"] = str(needed)
    if request.prefill and max(request.prefill) >= CACHED_MIN_TOKENS and "enable_prefix_caching" not in raw:
        sized["enable_prefix_caching"] = True  # the cached leg
    if not sized:
        return settings
    settings = resolve_settings({**raw, **sized}, behavior, auto_slots=auto)
    opts = {option_of(name) for name in sized}
    table = tuple(
        dataclasses.replace(p, requested="", rule=SIZED_RULE) if p.setting in opts else p for p in settings.provenance
    )
    return dataclasses.replace(settings, provenance=table)


@click.command("diff", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--checkpoint", required=True, help="Checkpoint directory or preset name (tiny).")
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16"]),
    help="Weight/activation dtype the model is served in [the checkpoint's own: config.json's dtype; presets float32].",
)
@click.option("--steps", type=int, required=True, help="Decode or verify steps per run (>= 2; --swap >= 4).")
@click.option("--prompts", "n_prompts", type=int, default=1, show_default=True, help="Prompts of the default mode.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Write the JSON report here.")
@click.option("--batch", help="Mode: multi-sequence decode at widths n,.. (each >= 2).")
@click.option("--fragment-slots", is_flag=True, help="Hold a spare slot before sequence n/2 (--batch, --verify-batch).")
@click.option("--verify", help="Mode: single-sequence verify at K,.. (2..4 each).")
@click.option("--mtp", is_flag=True, help="Also propose with the MTP drafter after each verify and compare it.")
@click.option("--verify-batch", help="Mode: batched verify of n,.. sequences (the scheduler's step).")
@click.option("--verify-batch-ks", help="The Ks of --verify-batch: uniform shapes per K, then one ragged mix.")
@click.option("--prefill", help="Mode: prefill parity at prompt lengths L,.. (single pass against chunked).")
@click.option("--prefill-chunk", help="The chunk sizes C,.. of --prefill.")
@click.option("--swap", is_flag=True, help="Mode: spill the sequence halfway, free, re-allocate, restore, continue.")
@click.option(
    "--generate", is_flag=True, help="Mode: the speculative scheduler (composed, fused) against greedy decoding."
)
@click.option("--confidence-stop", type=float, help="--generate: cut drafts below this log-confidence.")
@click.option(
    "--tier-slots",
    is_flag=True,
    help="--verify-batch: spread the sequences over every tier of the K ladder (two per tier from its first "
    "slot when the width allows; spares hold the slots between), each capped at its slot's K.",
)
@click.option(
    "--vocab-stress",
    is_flag=True,
    help="The engine's head, in every run compared, swaps each row's argmax onto id 0 or the last id for a third "
    "of the rows each, so paths gated on edge token values run.",
)
@click.option(
    "--forwards", help=f"Variants to compare with the reference, comma-separated [all: {','.join(known_labels())}]."
)
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report instead of the summary.")
@sampling_options
@serve_options
@click.pass_context
@user_errors
def diff(
    ctx,
    checkpoint,
    dtype,
    steps,
    n_prompts,
    out,
    batch,
    fragment_slots,
    verify,
    mtp,
    verify_batch,
    verify_batch_ks,
    prefill,
    prefill_chunk,
    swap,
    generate,
    confidence_stop,
    tier_slots,
    vocab_stress,
    forwards,
    as_json,
    temperature,
    top_k,
    top_p,
    min_p,
    seed,
    **serve,
):
    """Run the engine's reference forward (xla), replay its exact inputs under every other
    forward (xla-repeat, pallas), and compare every step's logits (and drafter output, and
    state) byte for byte, with a detection control. Modes: default (decode), --batch,
    --verify, --verify-batch, --prefill, --swap, --generate. Exit 1 on FAIL."""
    request = DiffRequest(
        steps=steps,
        prompts=n_prompts,
        batch=_ints("--batch", batch),
        fragment_slots=fragment_slots,
        verify=_ints("--verify", verify),
        mtp=mtp,
        verify_batch=_ints("--verify-batch", verify_batch),
        verify_batch_ks=_ints("--verify-batch-ks", verify_batch_ks),
        prefill=_ints("--prefill", prefill),
        prefill_chunk=_ints("--prefill-chunk", prefill_chunk),
        swap=swap,
        sampling=parse_sampling(temperature, top_k, top_p, min_p, seed),
        generate=generate,
        confidence_stop=confidence_stop,
        tier_slots=tier_slots,
        vocab_stress=vocab_stress,
    )
    request.check()
    sink = OutputFile(out)
    names = None if forwards is None else [f.strip() for f in forwards.split(",") if f.strip()]
    unknown = sorted(set(names or ()) - set(known_labels()))
    if unknown:
        raise UsageError(f"--forwards: unknown {', '.join(unknown)} (choose from {', '.join(known_labels())})")
    raw = pop_serve_raw(ctx, serve)
    if raw.get("speculative_sampling") == "rejection" and request.sampling is not None:
        raise UsageError("--speculative-sampling rejection: the sampled diff checks gumbel speculative sampling only")
    cfg, params = resolve_checkpoint(checkpoint, dtype)
    cfg = dataclasses.replace(cfg, vocab_stress=vocab_stress)
    settings = _settings(checkpoint, raw, request)
    pools = serve_pools(cfg, settings, params["embed"].dtype)
    require_room("this diff's engine", pools, "lower --steps, --max-seq-len or --max-batch-size")
    engine = Engine(cfg, params, settings)
    del params  # NOTE: the engine holds the weights in its own layout (f32 on CPU: transposed); one copy, not two
    variants, unavailable = default_variants(names)
    try:
        report = run_diff(engine, request, variants, unavailable, progress=Bar())
    except EngineError as e:
        raise UsageError(f"the engine refused a step of this diff: {e}") from None
    clamped = request.clamped(engine.counts, engine.settings.k_ladder)
    report = {"checkpoint": checkpoint, **report, "clamped": clamped}
    text = to_json(report)
    sink.write(text.encode("utf-8"))
    for line in clamped:
        click.echo(f"note: {line}", err=True)
    click.echo(text if as_json else render_summary(report), nl=False)
    if report["verdict"] != "PASS":
        ctx.exit(1)
