"""The step clock and the one steady-state throughput of a generation on the engine.

Owns: `StepClock` (the progress callback of one `greedy_generate` / `speculative_generate` call:
it marks every report) and the steady-state throughput it measures (`StepClock.rate`), the one
definition `generate`, the research studies (`research.Study.throughput`, the notebooks) and the
e2e benchmark report.

Steady-state throughput: a generation reports after its prefills (each sequence's first token)
and after every scheduler step (a decode, or a verify with its verdict and the next drafts); a
*step* is the interval between two consecutive reports, so the prefills are in no step and the
first step also holds the first propose. The warm steps are those during which the engine
compiled no program (every step when the clock has no `ProgramCache`). Steady-state throughput =
the tokens the warm steps emitted (each sequence counted up to max_new_tokens) / the seconds they
took (`time.perf_counter` at the reports). Prefill, compilation and whatever a call does before
its first report or after its last (allocation, freeing) are never counted.

Invariants:
- A clock only reads: the time, the tokens it is told and the cache's compilation count.
- With every program compiled beforehand, the steady state is exactly the tokens emitted from
  the first report to the last over the time between them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import NamedTuple

from metrale_jax.engine.programs import ProgramCache


class Mark(NamedTuple):
    """One report: its `time.perf_counter()`, the tokens emitted so far and the programs the
    engine had compiled so far (0 without a `ProgramCache`)."""

    seconds: float
    emitted: int
    compilations: int


@dataclasses.dataclass
class StepClock:
    """The `progress` callback of one generation: marks every report. `programs`: the engine's
    `ProgramCache`, whose compilations take a step out of the steady state (None: every step is
    warm); `on_tokens`: called with the tokens each report adds (e.g. a progress bar's advance)."""

    programs: ProgramCache | None = None
    on_tokens: Callable[[int], None] | None = None
    marks: list[Mark] = dataclasses.field(default_factory=list)

    def __call__(self, emitted: int) -> None:
        compilations = self.programs.compilations if self.programs is not None else 0
        mark = Mark(time.perf_counter(), emitted, compilations)
        if self.on_tokens is not None:
            self.on_tokens(emitted - (self.marks[-1].emitted if self.marks else 0))
        self.marks.append(mark)

    def _warm(self) -> list[tuple[Mark, Mark]]:
        """The warm steps, as (the report that opens it, the one that closes it)."""
        return [(a, b) for a, b in zip(self.marks, self.marks[1:]) if a.compilations == b.compilations]

    @property
    def warm_steps(self) -> int:
        return len(self._warm())

    @property
    def warm_tokens(self) -> int:
        return sum(b.emitted - a.emitted for a, b in self._warm())

    @property
    def warm_seconds(self) -> float:
        return sum(b.seconds - a.seconds for a, b in self._warm())

    def rate(self) -> float:
        """Steady-state throughput, tokens/s (the module's definition); NaN without a warm step."""
        return self.warm_tokens / self.warm_seconds if self.warm_steps else float("nan")

    def line(self) -> str:
        """The steady state in one line, for a report."""
        if not self.warm_steps:
            return "steady state: not measured (every step compiled a program; ask for more --max-new-tokens)"
        return (
            f"steady state: {self.rate():.1f} tokens/s ({self.warm_tokens} tokens in the "
            f"{self.warm_steps} steps that compiled nothing)"
        )
