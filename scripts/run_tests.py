#!/usr/bin/env python3
"""The test suite's runner: each test module in a pytest process of its own, `--jobs` at a time.

Owns: what `make test` and `make test-fast` run. Why one process per module: XLA CPU maps every
loaded executable's code separately and a process keeps what it compiled, its allocator's
high-water mark and its mappings (bounded by `vm.max_map_count`) until it ends; over the ~1,000
tests of the suite one process died in an XLA compile (SIGABRT, no message) late in the run, in
tests that pass alone. A module's process starts with nothing a previous module compiled, so each
module's cost is bounded by itself.

Usage: `python scripts/run_tests.py [--jobs N] [--slowest N] [PATH ...] [PYTEST ARGS ...]`: a PATH (a test
file or a folder of them) narrows the modules run (default: every tests/test_*.py); every other
argument goes to each pytest process (`-m "not slow"`, `-k ...`, `-x` per module).

Invariants:
- every tests/test_*.py runs exactly once, in its own process; the largest files start first
  (a packing heuristic: a long module started last would run alone at the end);
- a module that passes (or selects no test: pytest's exit 5) prints one line (its counts, wall time
  and the process's peak resident memory); any other exit, a signal included, prints its whole output;
- the exit status is 0 only when every module passed or selected no test;
- the `--slowest` tests of the whole run are listed at the end, from each module's JUnit XML
  (setup, call and teardown together), as pytest's `--durations` would list them.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
#: pytest's exit status when the arguments select no test of a module (e.g. `-m "not slow"`).
NO_TESTS_SELECTED = 5


@dataclass
class Outcome:
    """One module's run: its exit status (negative: the signal that ended it), wall time, peak RSS."""

    module: Path
    status: int
    seconds: float
    peak_mib: float
    log: Path
    junit: Path

    @property
    def ok(self) -> bool:
        return self.status in (0, NO_TESTS_SELECTED)

    def summary(self) -> str:
        lines = self.log.read_text(errors="replace").strip().splitlines()
        last = lines[-1].strip("= ") if lines else "no output"
        if self.status < 0:
            last = f"killed by {signal.Signals(-self.status).name}; {last}"
        verdict = "ok  " if self.ok else "FAIL"
        return f"{verdict} {self.module.name:<40} {last} [{self.seconds:.0f} s, peak {self.peak_mib:,.0f} MiB]"


def modules(paths: list[Path] | None = None) -> list[Path]:
    """The test modules in `paths` (files, or folders' test_*.py; default: every one in TESTS), each
    once, largest file first."""
    found: set[Path] = set()
    for p in paths or [TESTS]:
        found |= set(p.glob("test_*.py")) if p.is_dir() else {p}
    return sorted((p.resolve() for p in found), key=lambda p: (-p.stat().st_size, p.name))


def default_jobs() -> int:
    """The CPUs this process may use, at most 2 (a module's process can hold several GB)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, 2))


def run(pending: list[Path], jobs: int, pytest_args: list[str], workdir: Path) -> list[Outcome]:
    """Run `pending` modules, `jobs` processes at a time; print each outcome as it ends."""
    running: dict[int, tuple[Path, float, Path, Path]] = {}
    done: list[Outcome] = []
    queue = list(pending)
    try:
        while queue or running:
            while queue and len(running) < jobs:
                module = queue.pop(0)
                log, junit = workdir / f"{module.stem}.log", workdir / f"{module.stem}.xml"
                cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={junit}"]
                with open(log, "wb") as out:
                    proc = subprocess.Popen([*cmd, *pytest_args, str(module)], cwd=ROOT, stdout=out, stderr=out)
                running[proc.pid] = (module, time.perf_counter(), log, junit)
            # NOTE: os.wait4, not Popen.wait: it also returns the child's own peak resident set.
            pid, status, usage = os.wait4(-1, 0)
            if pid not in running:
                continue
            module, t0, log, junit = running.pop(pid)
            code = os.waitstatus_to_exitcode(status)
            outcome = Outcome(module, code, time.perf_counter() - t0, usage.ru_maxrss / 1024, log, junit)
            done.append(outcome)
            print(outcome.summary(), flush=True)
            if not outcome.ok:
                print(log.read_text(errors="replace"), flush=True)
    finally:
        for pid in running:
            os.kill(pid, signal.SIGTERM)
    return done


def slowest(outcomes: list[Outcome], n: int) -> list[tuple[float, str]]:
    """The `n` longest test cases over every module's JUnit XML (seconds, pytest node id)."""
    cases = []
    for o in outcomes:
        if not o.junit.exists():
            continue
        for case in ET.parse(o.junit).iter("testcase"):
            cls, name = case.get("classname", ""), case.get("name", "")
            cases.append((float(case.get("time", 0.0)), f"{cls.replace('.', '/')}.py::{name}"))
    return sorted(cases, reverse=True)[:n]


def totals(outcomes: list[Outcome]) -> dict[str, int]:
    """Test counts summed over every module's JUnit XML."""
    keys = ("tests", "failures", "errors", "skipped")
    total = dict.fromkeys(keys, 0)
    for o in outcomes:
        if o.junit.exists():
            for suite in ET.parse(o.junit).iter("testsuite"):
                for k in keys:
                    total[k] += int(suite.get(k, 0))
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=default_jobs(), help="modules at a time (default: %(default)s)")
    ap.add_argument("--slowest", type=int, default=20, help="list the N slowest tests (default: %(default)s)")
    args, rest = ap.parse_known_args(argv)
    if args.jobs < 1 or args.slowest < 0:
        ap.error("--jobs must be >= 1 and --slowest >= 0")
    paths = [Path(a) for a in rest if not a.startswith("-") and Path(a).exists()]
    pytest_args = [a for a in rest if a not in {str(p) for p in paths}]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="metrale-tests-") as tmp:
        outcomes = run(modules(paths), args.jobs, pytest_args, Path(tmp))
        counts = totals(outcomes)
        if args.slowest:
            print(f"\nslowest {args.slowest} tests (setup + call + teardown):")
            for seconds, node in slowest(outcomes, args.slowest):
                print(f"{seconds:9.2f}s {node}")
    failed = [o.module.name for o in outcomes if not o.ok]
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    print(
        f"\n{len(outcomes)} modules in {time.perf_counter() - t0:.0f} s ({args.jobs} at a time): {passed} passed, "
        f"{counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped"
        + (f"; FAILED modules: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
