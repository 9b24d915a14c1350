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
from rich.progress import ProgressColumn, Task, TaskID, TextColumn, TimeElapsedColumn
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
        self._task: TaskID | None = None
        self._done, self._total = 0, 0

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
        self._done, self._total = 0, max(total, 1)
        self._task = self._display.add_task(label, total=self._total)

    def advance(self, units: int = 1) -> None:
        if self._display is not None and self._task is not None:
            self._done = min(self._done + units, self._total)
            self._display.update(self._task, completed=self._done)

    def close(self) -> None:
        if self._display is not None:
            self._display.stop()
        self._display, self._task = None, None
