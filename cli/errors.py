"""How every command reports a user error: one clear line per problem on stderr and exit code 2,
never a traceback.

Owns `UsageError` (a bad combination of a command's own flags) and `user_errors`, the decorator
every command wears. A user error is any `metrale_jax.errors.MetraleError`: each layer raises its
own subclass, and no command registers anything.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import click

from metrale_jax.errors import MetraleError


class UsageError(MetraleError, ValueError):
    """A bad combination of flags or inputs detected by a command itself."""


def user_errors[**P, R](fn: Callable[P, R]) -> Callable[P, R]:
    """Decorator: a `MetraleError` becomes one `error: <line>` on stderr per message, then exit 2."""

    @functools.wraps(fn)
    def wrapper(*a: P.args, **kw: P.kwargs) -> R:
        try:
            return fn(*a, **kw)
        except MetraleError as e:
            for line in e.messages:
                click.echo(f"error: {line}", err=True)
            sys.exit(2)

    return wrapper
