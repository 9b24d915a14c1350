"""How every command reports a user error: one clear line on stderr and exit code 2, never a
traceback. Owns the list of exception types that count as user errors."""

from __future__ import annotations

import functools
import sys

import click

from metrale_jax.checkpoint import CheckpointError
from metrale_jax.config import ConfigError


class UsageError(ValueError):
    """A bad combination of flags or inputs detected by a command itself."""


USER_ERRORS: tuple[type[BaseException], ...] = (CheckpointError, ConfigError, UsageError)


def register_user_error(exc_type: type[BaseException]) -> None:
    """Let a subsystem (settings, recipes, engine) declare its own user-error type."""
    global USER_ERRORS
    if exc_type not in USER_ERRORS:
        USER_ERRORS = USER_ERRORS + (exc_type,)


def user_errors(fn):
    """Decorator: user errors -> `error: <message>` on stderr and exit 2."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except USER_ERRORS as e:
            for line in getattr(e, "messages", None) or [str(e)]:
                click.echo(f"error: {line}", err=True)
            sys.exit(2)

    return wrapper
