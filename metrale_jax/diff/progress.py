"""Progress of a diff: sections of known size, advanced once per prefill and per step.

Owns: `Progress` (the silent sink; `SILENT` is the library functions' default) and `Bar` (one
rich progress line per section on a terminal stream, which the CLI passes).

Invariants:
- Progress never writes to stdout: a `Bar` draws on its own stream (stderr by default) and
  redirects neither stdout nor stderr while it is live.
- A `Bar` draws nothing, and starts no display, when its stream is not a terminal.
"""

from __future__ import annotations

import sys
from typing import TextIO

from rich.console import Console
from rich.progress import Progress as RichProgress
from rich.progress import ProgressColumn, Task, TextColumn, TimeElapsedColumn
from rich.text import Text


class Progress:
    """Silent progress: `section(label, total)` starts a section of `total` units; `advance()`
    counts one unit; `close()` ends the last section."""

    def section(self, label: str, total: int) -> None:
        pass

    def advance(self, units: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


#: The default of every library function that reports progress: draws nothing.
SILENT = Progress()


class _HashBar(ProgressColumn):
    """`[####....]`: a fixed-width ASCII bar (plain text, so a pipe or log shows no box glyphs)."""

    WIDTH = 24

    def render(self, task: Task) -> Text:
        total = task.total or 1
        fill = int(self.WIDTH * min(task.completed, total) // total)
        return Text(f"[{'#' * fill}{'.' * (self.WIDTH - fill)}]")


class Bar(Progress):
    """A rich progress display on `stream` (stderr): one line per section (label, bar, done/total,
    the section's elapsed time), finished sections left in place; `close()` ends the display."""

    def __init__(self, stream: TextIO = sys.stderr):
        self.stream = stream
        self.live = stream.isatty()
        self._display: RichProgress | None = None

    def section(self, label: str, total: int) -> None:
        if not self.live:
            return
        if self._display is None:
            self._display = RichProgress(
                TextColumn("{task.description}"),
                _HashBar(),
                TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(),
                console=Console(file=self.stream),
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self._display.start()
        self._display.add_task(label, total=max(total, 1))

    def advance(self, units: int = 1) -> None:
        if self._display is not None and self._display.tasks:
            task = self._display.tasks[-1]  # the current section
            self._display.update(task.id, completed=min(task.completed + units, task.total or 1))

    def close(self) -> None:
        if self._display is not None:
            self._display.stop()
        self._display = None
