"""The serve flags: their table, as Click options, and a serve argv parsed by them.

Owns: `SERVE_FLAGS` (every serve flag: its setting's name, value type, help text and, for a
presence-only boolean, the negative spelling), `serve_options` (the decorator that gives a
command every flag), `pop_serve_raw` (the flags a command line gave) and `parse_serve_argv` (a
`serve MODEL [flags]` argv, as a recipe renders it, parsed by the same options).

Invariants:
- `SERVE_FLAGS` names every setting of `metrale_jax.engine.settings.SERVE_DEFAULTS` once, in
  its order; a flag's default is read from there, its spelling from `option_of`, never restated
  here. A presence-only boolean (`type is bool`) is rendered as `--flag/--off`.
- Raw settings hold only the flags the command line gave (not Click's defaults), so
  `resolve_settings` knows what was asked for and fills the rest from the table.
- A flag is given at most once per command line: a repeat (`--max-seq-len 64 --max-seq-len
  128`, `--speculative --no-speculative`) is refused, never resolved to the last value.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import click

from metrale_jax.engine.settings import SERVE_DEFAULTS, SettingsError, option_of


@dataclasses.dataclass(frozen=True)
class ServeFlag:
    """One serve flag: its parameter name (an `EngineSettings` field, or `mtp_k_ladder`), the
    type its value parses as, its help text, and for a presence-only boolean (`type is bool`)
    the negative spelling `off`."""

    name: str
    type: type
    help: str
    off: str | None = None

    @property
    def default(self) -> Any:
        """The setting's default (`SERVE_DEFAULTS`)."""
        return SERVE_DEFAULTS[self.name]

    @property
    def opt(self) -> str:
        """The flag's spelling on a command line (`max_seq_len` -> `--max-seq-len`)."""
        return option_of(self.name)

    @property
    def spellings(self) -> tuple[str, ...]:
        """Every spelling of the flag: `opt`, then `off` for a presence-only boolean."""
        return (self.opt,) if self.off is None else (self.opt, self.off)


SERVE_FLAGS: tuple[ServeFlag, ...] = (
    ServeFlag("max_batch_size", str, "Sequence slots: N (1..=128) or auto (fit to memory)."),
    ServeFlag("max_seq_len", int, "Longest sequence, prompt + output tokens."),
    ServeFlag("block_size", int, "Tokens per paged-KV block."),
    ServeFlag("speculative", bool, "MTP speculative decoding.", off="--no-speculative"),
    ServeFlag("num_drafts", int, "Drafts per verify [MODEL.toml default_num_drafts, else 1]; K = drafts + 1."),
    ServeFlag("mtp_max_seqs", int, "MTP dispatch cap, 1..=128 [MODEL.toml mtp_max_seqs, else 32]."),
    ServeFlag("mtp_k_ladder", str, "K ladder n_max:drafts,... [4:3,8:3,16:1,32:1]: drafts at n active sequences."),
    ServeFlag("kv_cache_dtype", str, "KV-cache dtype bf16|fp8|f32 [MODEL.toml default_kv_dtype, else fp8]."),
    ServeFlag("ssm_h_dtype", str, "Recurrent h-state pool dtype f32|f16-pool [f32]."),
    ServeFlag("ssm_rollback_mode", str, "Verify rollback: snapshot (per-draft states) or replay."),
    ServeFlag("max_prefill_tokens", int, "Prefill chunk in tokens (8192 = unset)."),
    ServeFlag("enable_prefix_caching", bool, "Prefix caching (with SSM snapshots).", off="--disable-prefix-caching"),
    ServeFlag("ssm_cache_slots", int, "Prefix-cache SSM snapshot (Marconi) slots."),
    ServeFlag("ssm_decode_ring_slots", str, "Decode-rollback ring depth: auto or 0..=8."),
    ServeFlag("gpu_memory_utilization", float, "Fraction of device memory to use, in (0, 1]."),
    ServeFlag("tensor_parallel_size", int, "Devices the heads are sharded over (divides KV and GDN key heads)."),
    ServeFlag("expert_parallel_size", int, "Devices the MoE experts are sharded over (divides the experts)."),
    ServeFlag(
        "batch_invariant",
        bool,
        "Batch-invariant arithmetic: a token's logits and state are the same bits in any batch, verify or chunk.",
        off="--no-batch-invariant",
    ),
    ServeFlag(
        "speculative_sampling",
        str,
        "Sampled speculative acceptance: gumbel (plain sampling's tokens) or rejection (min(1, p/q), its law).",
    ),
)


def serve_options[F: Callable[..., Any]](f: F) -> F:
    """Decorate a Click command with every serve flag (parameters named as `EngineSettings`
    fields, plus `mtp_k_ladder`). Values stay raw (a tuple of every occurrence): pass them
    through `pop_serve_raw`, then to `resolve_settings`."""
    for flag in reversed(SERVE_FLAGS):
        # NOTE: multiple=True only so that `pop_serve_raw` sees a flag given twice.
        if flag.type is bool:
            f = click.option(f"{flag.opt}/{flag.off}", flag.name, default=(), multiple=True, help=flag.help)(f)
        else:
            f = click.option(
                flag.opt,
                flag.name,
                type=flag.type,
                default=(),
                multiple=True,
                show_default=False if flag.default is None else str(flag.default),
                help=flag.help,
            )(f)
    return f


def pop_serve_raw(ctx: click.Context, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Remove the serve flags from a command's `kwargs`; return those given on the command line
    (not defaulted), ready for `resolve_settings`, which then knows what was asked for.

    Raises SettingsError naming every flag given more than once (a later value never silently
    replaces an earlier one; recipes override theirs explicitly, `recipes.override_flags`)."""
    raw = {name: tuple(kwargs.pop(name)) for name in list(kwargs) if name in _FLAGS}
    given = {
        name: values
        for name, values in raw.items()
        if values and ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT
    }
    repeated = [
        f"{_FLAGS[name].opt} given {len(values)} times ({', '.join(_spelled(_FLAGS[name], v) for v in values)}): "
        "give it once"
        for name, values in given.items()
        if len(values) > 1
    ]
    if repeated:
        raise SettingsError(repeated)
    return {name: values[0] for name, values in given.items()}


_FLAGS = {flag.name: flag for flag in SERVE_FLAGS}


def _spelled(flag: ServeFlag, value: Any) -> str:
    """One occurrence of `flag` as the command line wrote it."""
    if flag.type is bool:
        return flag.opt if value else str(flag.off)
    return f"{flag.opt} {value}"


@functools.cache
def _serve_command() -> click.Command:
    """`serve MODEL [serve flags]`, built from `serve_options`; only ever parsed, never invoked."""
    return click.command("serve")(click.argument("model")(serve_options(lambda **_: None)))


def parse_serve_argv(argv: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """Parse `[model, serve flags...]` with the serve option set: `(model, raw settings)`.

    The raw settings (only the flags the argv gives) go to `resolve_settings`. A flag Click
    refuses (unknown, missing value, bad integer) raises SettingsError with Click's message.
    """
    try:
        ctx = _serve_command().make_context("metrale-jax serve", list(argv))
    except click.ClickException as e:
        raise SettingsError([f"serve flags: {e.format_message()}"]) from None
    params = dict(ctx.params)
    model = params.pop("model")
    return model, pop_serve_raw(ctx, params)
