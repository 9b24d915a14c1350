"""A command's `--out` file: checked before the work, written atomically after it.

Owns `OutputFile`. A command claims its destination first (`OutputFile(path)`: refused with one
clear line when it can never be written: under a regular file, a directory, a read-only or
virtual file system), does its work, then `write`s the whole content at once.

Invariants:
- `write` puts the bytes in a temporary file in the destination's directory, flushes them to
  disk, then renames it over the destination: a reader sees the old file or the new one, never
  a part. A failed or interrupted write (full disk, Ctrl-C) removes the temporary file and any
  directory it created, and leaves an earlier file at the path untouched.
- The path written is exactly the path given (no suffix is added).
- Every failure is an `OutputError` (a `MetraleError`: exit 2) naming the flag and the path.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from metrale_jax.errors import MetraleError
from metrale_jax_cli import interrupts


class OutputError(MetraleError):
    """A `--out` destination that cannot be written (one clear line)."""


def _reason(e: OSError) -> str:
    return e.strerror or type(e).__name__


class OutputFile:
    """The destination `path` of `flag`, claimed now and written once by `write`."""

    def __init__(self, path: str | os.PathLike, flag: str = "--out"):
        self.path = Path(os.path.abspath(path))
        self.flag = flag
        if self.path.is_dir():
            raise OutputError(f"{flag} {path}: is a directory")
        existing = self.path.parent
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            raise OutputError(f"{flag} {path}: {existing} is not a directory")
        try:  # the same kind of file `write` makes, where it will make it (or the nearest ancestor)
            fd, probe = tempfile.mkstemp(dir=existing, prefix=".metrale-jax-probe-")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise OutputError(f"{flag} {path}: cannot write in {existing} ({_reason(e)})") from None

    def write(self, data: bytes) -> None:
        """Replace the destination by `data`, atomically (see the module invariants)."""
        created: list[Path] = []
        tmp = None
        done = False
        try:
            missing = [p for p in (self.path.parent, *self.path.parent.parents) if not p.exists()]
            for d in reversed(missing):
                d.mkdir()
                created.append(d)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), 0o666 & ~_umask())  # what open() would have made
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            interrupts.raise_if_interrupted()
            os.replace(tmp, self.path)
            done = True
        except OSError as e:
            raise OutputError(f"{self.flag} {self.path}: writing failed ({_reason(e)}); nothing was written") from None
        finally:
            if not done:
                if tmp is not None:
                    os.unlink(tmp)
                for d in reversed(created):
                    d.rmdir()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
