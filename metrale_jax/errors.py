"""The one base class of every user-facing error, and the one reader of user text files.

Owns `MetraleError` and `read_text` (a file the user names, as UTF-8 text: a recipe, MODEL.toml,
a tokens file). A user-facing error is a problem with what the user asked for (a flag, a
file, a checkpoint, a recipe, a request the engine cannot serve), not a bug: the CLI catches
`MetraleError` alone and prints each of its `messages` as one `error: <line>` on stderr, then
exits with status 2, never with a traceback.

Invariants:
- `messages` is a tuple of lines; it is `(str(self),)` unless a subclass collected several.
- This module imports only the standard library (no package module, no third-party library),
  so every layer may import it without pulling in a layer above it.
"""

from __future__ import annotations

import os


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


def read_text(path: str | os.PathLike, error: type[MetraleError] = MetraleError) -> str:
    """The file at `path` as UTF-8 text. Raises `error` (one line naming the file) when it cannot
    be read, or when it is not UTF-8, naming the first bad byte and its offset."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise error(f"{os.fspath(path)}: cannot read ({e.strerror or type(e).__name__})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(
            f"{os.fspath(path)}: not UTF-8 text (byte 0x{data[e.start]:02x} at byte offset {e.start})"
        ) from None
