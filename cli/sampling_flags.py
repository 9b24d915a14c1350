"""The sampling flags (`--temperature --top-k --top-p --min-p --seed`) of `generate` and `diff`.

Owns: `sampling_options` (the decorator giving a command the five flags) and `parse_sampling`
(their values as one `engine.sampling.Sampling`, or None for greedy).

Invariants:
- The values arrive as text and are parsed here, so a bad one (negative temperature, top-p
  outside (0, 1], top-k < 0, a seed that is not an integer) is one `error:` line and exit 2
  (`UsageError`), refused before any model is loaded.
- No flag, or temperature 0 with no other flag, is greedy: the greedy programs, byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from metrale_jax.engine.sampling import Sampling, sampling_problems
from metrale_jax_cli.errors import UsageError

_FLAGS = (
    ("--temperature", "Sampling temperature (0: greedy, the default)."),
    ("--top-k", "Keep the k most likely tokens (0: off), after the temperature."),
    ("--top-p", "Keep the most likely tokens up to this probability mass, in (0, 1] (1: off), after top-k."),
    ("--min-p", "Keep tokens at least this fraction of the most likely one's probability (0: off), after top-p."),
    ("--seed", "The request's sampling seed (an integer; draws depend on it and the position only)."),
)


def sampling_options[F: Callable[..., Any]](fn: F) -> F:
    """Give a command the five sampling flags (parameters temperature, top_k, top_p, min_p, seed)."""
    for flag, help_text in reversed(_FLAGS):
        fn = click.option(flag, type=str, default=None, help=help_text)(fn)
    return fn


def _number(flag: str, text: str | None, parse: Callable[[str], Any], default: Any) -> Any:
    if text is None:
        return default
    try:
        return parse(text)
    except ValueError:
        kind = "an integer" if parse is int else "a number"
        raise UsageError(f"{flag} {text!r} is not {kind}") from None


def parse_sampling(
    temperature: str | None, top_k: str | None, top_p: str | None, min_p: str | None, seed: str | None
) -> Sampling | None:
    """The flags' `Sampling` (None: greedy, no flag set or temperature 0 alone). Refused
    (`UsageError`): a value that does not parse, `sampling_problems`, or a filter or seed without
    a positive temperature (it would be ignored)."""
    values = (
        _number("--temperature", temperature, float, 0.0),
        _number("--top-k", top_k, int, 0),
        _number("--top-p", top_p, float, 1.0),
        _number("--min-p", min_p, float, 0.0),
        _number("--seed", seed, int, 0),
    )
    problems = sampling_problems(*values)
    if problems:
        raise UsageError("; ".join(problems))
    s = Sampling(*values)
    given = [f for f, v in zip(("--top-k", "--top-p", "--min-p", "--seed"), (top_k, top_p, min_p, seed)) if v]
    if s.greedy and given:
        raise UsageError(f"{', '.join(given)} need(s) --temperature > 0 (temperature 0 is greedy)")
    return None if s.greedy else s
