"""`metrale-jax logits`: the logits of every prompt position and of N greedy decode steps, for
parity checks against other engines. Owns only argument handling; the math is
`metrale_jax.model.cache.prefill_and_decode`.

Invariants: `--out` is claimed before the work and written atomically after it, at exactly the
path given (`metrale_jax_cli.output`); the cache and the logits are checked against the local
device's memory before anything is allocated (`metrale_jax.memory.plan.require_room`).
"""

from __future__ import annotations

import io

import click
import numpy as np

from metrale_jax.errors import read_text
from metrale_jax.memory.plan import Term, allocation_terms, require_room
from metrale_jax.model.cache import new_cache, prefill_and_decode
from metrale_jax.presets import resolve_checkpoint
from metrale_jax_cli.errors import UsageError, user_errors
from metrale_jax_cli.output import OutputFile


def _parse_tokens(tokens: str | None, tokens_file: str | None, vocab: int) -> list[int]:
    if (tokens is None) == (tokens_file is None):
        raise UsageError("give exactly one of --tokens and --tokens-file")
    if tokens_file is not None:
        tokens = read_text(tokens_file, UsageError)
    try:
        out = [int(t) for t in (tokens or "").replace(",", " ").split()]
    except ValueError:
        raise UsageError("tokens must be integers separated by commas or whitespace") from None
    if not out:
        raise UsageError("no tokens given")
    bad = [t for t in out if not 0 <= t < vocab]
    if bad:
        raise UsageError(f"token(s) {bad[:5]} outside the vocabulary 0..{vocab - 1}")
    return out


@click.command("logits")
@click.option("--checkpoint", required=True, help="Checkpoint directory or preset name (tiny).")
@click.option("--tokens", help="Comma-separated prompt token ids.")
@click.option("--tokens-file", type=click.Path(exists=True, dir_okay=False), help="File of token ids.")
@click.option(
    "--decode",
    "decode_steps",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Greedy decode steps after the prefill.",
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16"]),
    help="Weight/activation dtype [the checkpoint's own: config.json's dtype; presets float32].",
)
@click.option("--out", type=click.Path(dir_okay=False), help="Write the logits [len+N, vocab] float32 .npy here.")
@user_errors
def logits(checkpoint, tokens, tokens_file, decode_steps, dtype, out):
    """Print a summary of (and optionally save) the logits of a prefill followed by greedy decode."""
    sink = OutputFile(out) if out else None
    cfg, params = resolve_checkpoint(checkpoint, dtype)
    dtype = str(params["embed"].dtype)
    prompt = _parse_tokens(tokens, tokens_file, cfg.vocab_size)
    rows = len(prompt) + decode_steps
    cache = allocation_terms("cache", lambda: new_cache(cfg, 1, rows + 1, params["embed"].dtype))
    # the logits rows on the device, once per step and once concatenated
    outputs = Term("logits", "outputs", 2 * rows * cfg.vocab_size * 4, "float32", (rows, cfg.vocab_size))
    require_room(f"{len(prompt)} prompt + {decode_steps} decode rows", (*cache, outputs), "lower --decode")
    lg, fed = prefill_and_decode(params, cfg, prompt, decode_steps)
    lg = np.asarray(lg, np.float32)
    if sink is not None:
        buf = io.BytesIO()
        np.save(buf, lg)
        sink.write(buf.getvalue())
    click.echo(
        f"model: {cfg.model_type}, {cfg.num_hidden_layers} layers "
        f"({cfg.num_linear_layers} GDN, {cfg.num_full_layers} attention), vocab {cfg.vocab_size}, {dtype}"
    )
    click.echo(f"logits: {lg.shape[0]} rows ({len(prompt)} prompt + {decode_steps} decode) x {lg.shape[1]}")
    click.echo(f"last prompt position: argmax {int(lg[len(prompt) - 1].argmax())}, max {lg[len(prompt) - 1].max():.4f}")
    if fed:
        click.echo(f"greedy continuation: {','.join(map(str, fed))}")
    if sink is not None:
        click.echo(f"wrote {out}")
