"""Progress of a diff: sections of known size, advanced once per prefill and per step.

Owns: `Progress` (the silent sink the library defaults to) and `Bar` (a one-line bar on a
terminal stream, which the CLI passes). Invariant: progress never writes to stdout, and a bar
draws nothing when its stream is not a terminal.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Silent progress: `section(label, total)` starts a section of `total` units; `advance()`
    counts one unit; `close()` ends the last section."""

    def section(self, label: str, total: int) -> None:
        pass

    def advance(self, units: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class Bar(Progress):
    """A bar redrawn in place on `stream` (stderr), with the section's elapsed seconds."""

    WIDTH = 24

    def __init__(self, stream: TextIO = sys.stderr):
        self.stream = stream
        self.live = stream.isatty()
        self.label, self.total, self.done, self.t0 = "", 0, 0, 0.0

    def section(self, label: str, total: int) -> None:
        self.close()
        self.label, self.total, self.done, self.t0 = label, max(total, 1), 0, time.monotonic()
        self._draw()

    def advance(self, units: int = 1) -> None:
        self.done = min(self.done + units, self.total)
        self._draw()

    def close(self) -> None:
        if self.live and self.label:
            self.stream.write("\n")
            self.stream.flush()
        self.label = ""

    def _draw(self) -> None:
        if not self.live:
            return
        fill = self.WIDTH * self.done // self.total
        self.stream.write(
            f"\r{self.label} [{'#' * fill}{'.' * (self.WIDTH - fill)}] "
            f"{self.done}/{self.total} {time.monotonic() - self.t0:.0f}s"
        )
        self.stream.flush()
