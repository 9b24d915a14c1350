"""How every command ends when it does not succeed: one `error:` line per problem on stderr and
an exit code that says which kind of end it was, never a traceback.

Owns `UsageError` (a bad combination of a command's own flags), the exit codes, `guarded` (the
one handler of a run's failures) and `user_errors`, the decorator every command wears. A user
error is any `metrale_jax.errors.MetraleError`: each layer raises its own subclass, and no
command registers anything.

Invariants:
- Exit codes: 2 a user error (each of its `messages` one `error:` line); 130 an interrupt
  (Ctrl-C, at any moment: one line); `INTERNAL_EXIT` an unexpected exception (one line naming it
  and the log file that holds its traceback). Exit 1 stays `diff`'s FAIL verdict, so no failure
  of the run itself can read as one.
- Click's own exits (`--help`, usage errors, `ctx.exit`) pass through untouched.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator

import click

from metrale_jax.errors import MetraleError
from metrale_jax_cli import interrupts

USER_EXIT = 2
INTERRUPT_EXIT = 130
#: BSD sysexits' EX_SOFTWARE: an internal software error.
INTERNAL_EXIT = 70
#: The directory crash logs go to (default: the system temporary directory).
LOG_DIR_ENV = "METRALE_JAX_LOG_DIR"


class UsageError(MetraleError, ValueError):
    """A bad combination of flags or inputs detected by a command itself."""


def _crash_log(e: BaseException) -> str:
    """Write `e`'s traceback (and the command line) to a fresh log file; its path, or a note
    saying why none could be written."""
    directory = os.environ.get(LOG_DIR_ENV) or tempfile.gettempdir()
    try:
        fd, path = tempfile.mkstemp(
            prefix=f"metrale-jax-{time.strftime('%Y%m%d-%H%M%S')}-", suffix=".log", dir=directory
        )
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(f"argv: {sys.argv!r}\n\n")
            f.write("".join(traceback.format_exception(e)))
        return path
    except OSError as err:
        return f"nowhere ({directory}: {err.strerror})"


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """Run a command's body: a `MetraleError` exits 2 with its lines, an interrupt 130 with one
    line, any other exception `INTERNAL_EXIT` with one line pointing at its crash log."""
    try:
        yield
        interrupts.raise_if_interrupted()
    except MetraleError as e:
        for line in e.messages:
            click.echo(f"error: {line}", err=True)
        sys.exit(USER_EXIT)
    except KeyboardInterrupt:
        click.echo("error: interrupted", err=True)
        sys.exit(INTERRUPT_EXIT)
    except (click.exceptions.Exit, click.ClickException, click.Abort):
        raise
    except Exception as e:
        log = _crash_log(e)
        click.echo(f"error: internal error ({type(e).__name__}: {e}); the traceback is in {log}", err=True)
        sys.exit(INTERNAL_EXIT)


def user_errors[**P, R](fn: Callable[P, R]) -> Callable[P, R]:
    """Decorator: the command's body runs `guarded` (see the module docstring for the exits)."""

    @functools.wraps(fn)
    def wrapper(*a: P.args, **kw: P.kwargs) -> R:
        with guarded():
            return fn(*a, **kw)

    return wrapper
