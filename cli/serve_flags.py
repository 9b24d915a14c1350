"""The serve flags as Click options, and a serve argv parsed by them.

Owns: `serve_options` (the decorator that gives a command every flag of
`metrale_jax.engine.settings.SERVE_FLAGS`), `pop_serve_raw` (the flags a command line gave) and
`parse_serve_argv` (a `serve MODEL [flags]` argv, as a recipe renders it, parsed by the same
options).

Invariants:
- The flag table is `SERVE_FLAGS`: names, defaults, types and help are read from it, never
  restated here; a presence-only boolean (`type is bool`) is rendered as `--flag/--off`.
- Raw settings hold only the flags the command line gave (not Click's defaults), so
  `resolve_settings` knows what was asked for and fills the rest from the table.
- A flag is given at most once per command line: a repeat (`--max-seq-len 64 --max-seq-len
  128`, `--speculative --no-speculative`) is refused, never resolved to the last value.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import click

from metrale_jax.engine.settings import SERVE_FLAGS, SERVE_SETTINGS, ServeFlag, SettingsError


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
    raw = {name: tuple(kwargs.pop(name)) for name in list(kwargs) if name in SERVE_SETTINGS}
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
