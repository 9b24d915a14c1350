"""Timing statistics, machine facts and the compile listener the benchmarks share.

Owns: `Stats` (median and spread of repeated timings), `paired` (alternated A/B timings and
their ratio), `back_to_back` (alternated blocks of consecutive calls: the steady state),
`machine_info` (load average, cores, versions: recorded next to every number) and
`CompileCounter` (backend compilations seen by JAX while it is active).

Invariant: nothing here asserts on wall time; numbers are reported, never checked.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.monitoring

from metrale_jax import runtime_env


@dataclasses.dataclass
class Stats:
    """Seconds of repeated runs: median, min, max, quartiles and the relative spread."""

    n: int
    median: float
    min: float
    max: float
    p25: float
    p75: float

    @classmethod
    def of(cls, xs: Sequence[float]) -> Stats:
        xs = sorted(float(x) for x in xs)
        if not xs:
            nan = float("nan")
            return cls(0, nan, nan, nan, nan, nan)
        q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
        return cls(len(xs), statistics.median(xs), xs[0], xs[-1], q[0], q[2])

    @property
    def spread(self) -> float:
        """(max - min) / median: the relative spread of the repeats."""
        return (self.max - self.min) / self.median if self.median else float("nan")

    def ms(self) -> str:
        return f"{1e3 * self.median:.3f}"


def paired(run_a: Callable[[], float], run_b: Callable[[], float], repeats: int, warmup: int):
    """Alternate A and B (A, B, B, A, A, B, ... so neither always runs first) after `warmup`
    untimed calls of each; each call returns its own seconds. Returns (Stats A, Stats B,
    Stats of the per-round ratios A/B)."""
    for _ in range(warmup):
        run_a()
        run_b()
    ta, tb = [], []
    for i in range(repeats):
        if i % 2 == 0:
            ta.append(run_a())
            tb.append(run_b())
        else:
            tb.append(run_b())
            ta.append(run_a())
    return Stats.of(ta), Stats.of(tb), Stats.of([a / b for a, b in zip(ta, tb)])


def back_to_back(block_a: Callable[[], Sequence[float]], block_b: Callable[[], Sequence[float]], rounds: int):
    """Alternate blocks of consecutive calls (A block, B block, then B first, ...): each block
    function runs its side R times back to back and returns the R seconds. Returns (Stats A and
    Stats B over every call, Stats of the per-round ratios of the block medians A/B).

    NOTE: `paired` puts the other side's call between two calls of a side, so every call starts
    after an idle gap of the other's length, and a step after an idle gap is slower (the core
    and its caches go cold; the `gap` section shows it). Blocks measure what a serving loop
    sees: steps back to back.
    """
    ta, tb, ratios = [], [], []
    for i in range(rounds):
        if i % 2 == 0:
            a, b = list(block_a()), list(block_b())
        else:
            b = list(block_b())
            a = list(block_a())
        ta += a
        tb += b
        ratios.append(statistics.median(a) / statistics.median(b))
    return Stats.of(ta), Stats.of(tb), Stats.of(ratios)


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def machine_info() -> dict:
    """Facts to print next to the numbers: cores, load, versions, backend, compile cache."""
    return {
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "jax_cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "hf_cpu": os.environ.get(runtime_env.SIBLING_CPU),
        "load_average_1_5_15": load_average(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "persistent_compile_cache": jax.config.jax_compilation_cache_dir or None,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


class CompileCounter:
    """Counts JAX backend compilations (and sums their seconds) while active (a context manager).

    Listens to `/jax/core/compile/backend_compile_duration`, which JAX records once per XLA
    compilation, cached or AOT alike; `reset()` starts a new count (e.g. after warm-up)."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0
        self.seconds = 0.0

    def _listener(self, name, secs, **_):
        if name == self.EVENT:
            self.count += 1
            self.seconds += secs

    def reset(self):
        self.count, self.seconds = 0, 0.0

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listener)
        return False
