"""The step clock (`metrale_jax.engine.throughput`): the steady state counts the steps after the
prefill that compiled no program, tokens over seconds, as `generate` prints it and the e2e
benchmark and the research studies report it."""

import io
import math

import pytest

from metrale_jax.diff.progress import Bar
from metrale_jax.engine import throughput
from metrale_jax.engine.programs import ProgramCache
from metrale_jax.engine.throughput import StepClock


def test_step_clock_counts_only_steps_that_compiled_nothing():
    programs = ProgramCache()
    clock = StepClock(programs, Bar(io.StringIO()).advance)
    programs.compilations += 2
    clock(5)  # after the prefill, which compiled: no step yet
    clock(9)
    clock(12)
    programs.compilations += 1
    clock(20)
    assert (clock.warm_steps, clock.warm_tokens) == (2, 7) and clock.warm_seconds > 0
    assert clock.line().startswith("steady state: ") and "7 tokens in the 2 steps" in clock.line()
    cold = StepClock(programs, Bar(io.StringIO()).advance)
    programs.compilations += 1
    cold(3)
    assert cold.line().startswith("steady state: not measured")


def test_step_clock_rates_tokens_between_its_first_and_last_report(monkeypatch):
    clock = StepClock()
    assert math.isnan(clock.rate())
    ticks = iter([1.0, 1.5, 3.0])
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: next(ticks))
    for emitted in (4, 10, 24):
        clock(emitted)
    assert clock.rate() == pytest.approx(10.0)  # (24 - 4) tokens over 2 s


def test_step_clock_passes_each_reports_new_tokens_on() -> None:
    seen: list[int] = []
    clock = StepClock(on_tokens=seen.append)
    for emitted in (2, 2, 5):
        clock(emitted)
    assert seen == [2, 0, 3] and [m.emitted for m in clock.marks] == [2, 2, 5]
    assert all(a.seconds <= b.seconds for a, b in zip(clock.marks, clock.marks[1:]))
