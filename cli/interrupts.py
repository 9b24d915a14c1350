"""Ctrl-C that cannot be lost: the command line's SIGINT handler and its check.

Owns `install` and `raise_if_interrupted`. Python runs a SIGINT handler between two bytecodes of
whatever code is running, and the KeyboardInterrupt it raises is discarded when that code is a
garbage-collection callback or a finaliser ("Exception ignored in ..."): JAX registers such a
callback, so a Ctrl-C during start-up could be lost and the command run to the end. The handler
installed here raises as Python's own does and also records the interrupt; `raise_if_interrupted`
raises it again where a command would commit its result (before an output file replaces an
earlier one, and when a command's body returns). The discarded raise is not reported (Python
would print its traceback): it is raised again.

Invariant: once SIGINT arrived, no command exits 0 and no output file is replaced.
"""

from __future__ import annotations

import signal
import sys

_interrupted = False
_report_unraisable = sys.unraisablehook


def _on_sigint(signum, frame) -> None:
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def _unraisable(info) -> None:
    if not (_interrupted and isinstance(info.exc_value, KeyboardInterrupt)):
        _report_unraisable(info)


def install() -> None:
    """Handle SIGINT as above (main thread only, as every Python signal handler)."""
    signal.signal(signal.SIGINT, _on_sigint)
    sys.unraisablehook = _unraisable


def raise_if_interrupted() -> None:
    """KeyboardInterrupt if SIGINT arrived since `install`, even where its first raise was discarded."""
    if _interrupted:
        raise KeyboardInterrupt
