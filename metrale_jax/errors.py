"""The one base class of every user-facing error.

Owns `MetraleError`. A user-facing error is a problem with what the user asked for (a flag, a
file, a checkpoint, a recipe, a request the engine cannot serve), not a bug: the CLI catches
`MetraleError` alone and prints each of its `messages` as one `error: <line>` on stderr, then
exits with status 2, never with a traceback.

Invariants:
- `messages` is a tuple of lines; it is `(str(self),)` unless a subclass collected several.
- This module imports nothing (no package module, no third-party library), so every layer may
  import it without pulling in a layer above it.
"""

from __future__ import annotations


class MetraleError(Exception):
    """A user-facing error: the CLI prints each of its `messages` as one `error:` line and exits 2.

    Subclasses that collect several problems set `messages` (one line each) after calling this
    `__init__`. A subclass may also inherit a builtin (`ValueError`, `RuntimeError`) where callers
    catch it by that type.
    """

    messages: tuple[str, ...]

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.messages = (str(self),)
