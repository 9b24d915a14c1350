"""Probe `thunk-profile`: where one step program's time goes on XLA CPU: the device time of each top-level op (thunk)
of a benchmark model's decode, verify or fused speculative step program, from XLA's own per-thunk trace events.

    .venv/bin/python -m benchmarks thunk-profile [MODEL] [KIND:N:K] [--top 30] [--iters 20]

MODEL: a `benchmarks.models.model` name (default qwen3-next-h512); KIND:N:K: a decode of N sequences (K = 1), a
verify of N sequences of K rows (default verify:1:4) or the fused speculative step of that verify and K - 1
drafts, captured by `step_times.captured_step` (128-token contexts). The captured program is compiled again
with `xla_cpu_enable_xprof_traceme` and run ITERS times under `jax.profiler.trace`; each op's time is its trace
events' total per run, listed with its result shape and the jax operation it came from.

NOTE: every traced thunk pays a few microseconds of tracing, so a program of many small ops (the `tiny` and
`small` presets) runs several times slower traced and its small ops read too long; at realistic widths the
traced 45 M programs measured 1.3-1.7x their untraced time (both are printed). A `while` or `call` op's time
includes its body's ops (an MoE `pairs` loop, the attention over KV blocks).
"""

import gzip
import json
import re
import tempfile
from collections import defaultdict
from pathlib import Path

import click
import jax
import numpy as np

from benchmarks import models
from benchmarks.probes.step_times import captured_step
from metrale_jax.engine.programs import compile_transition

TRACEME = {"xla_cpu_enable_xprof_traceme": True}
# An instruction line of optimized HLO: its name and what follows the "="
# ("%fusion.3 = f32[4,512]{1,0} fusion(%a), ...").
_INSTRUCTION_RE = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
# The opcode: the word whose "(" opens the operands (an operand or nothing), after a result type that may be a tuple.
_OPCODE_RE = re.compile(r"\s([\w\-]+)\((?:%|\))")
_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')


def instructions(hlo_text: str) -> dict[str, str]:
    """{instruction name: 'result type, opcode, jax op'} of an optimized HLO module's entry computation."""
    entry = hlo_text.split("ENTRY", 1)[-1]
    out = {}
    for line in entry.splitlines():
        m = _INSTRUCTION_RE.match(line)
        opcode = _OPCODE_RE.search(m.group(2)) if m else None
        if m and opcode:
            rest = m.group(2)
            result = "tuple" if rest.startswith("(") else rest.split("{", 1)[0].split(" ", 1)[0]
            op = _OP_NAME_RE.search(line)
            out[m.group(1)] = f"{result} {opcode.group(1)} {op.group(1) if op else ''}"
    return out


def thunk_totals(trace_dir: Path) -> dict[str, float]:
    """{event name: total microseconds} over the complete events of the trace `jax.profiler` wrote."""
    path = next(trace_dir.rglob("*.trace.json.gz"))
    with gzip.open(path) as f:
        doc = json.load(f)
    totals: dict[str, float] = defaultdict(float)
    for e in doc["traceEvents"] if isinstance(doc, dict) else doc:
        if e.get("ph") == "X":
            totals[e.get("name", "")] += e.get("dur", 0)
    return totals


@click.command("thunk-profile", help="The device time of each top-level op of a step program (XLA CPU trace).")
@click.argument("model", default="qwen3-next-h512")
@click.argument("step", default="verify:1:4")
@click.option("--top", default=30, show_default=True, help="ops listed, longest first")
@click.option("--iters", default=20, show_default=True, help="traced runs")
def command(model: str, step: str, top: int, iters: int) -> None:
    kind, *sizes = step.split(":")
    if (
        kind not in ("decode", "verify", "fused")
        or len(sizes) != 2
        or not all(x.isdigit() and int(x) > 0 for x in sizes)
    ):
        raise click.BadParameter(f"{step!r}: decode:N:1, verify:N:K or fused:N:K with N, K >= 1", param_hint="STEP")
    if kind == "fused" and sizes[1] == "1":
        raise click.BadParameter(f"{step!r}: a fused step verifies K >= 2 rows (K - 1 drafts)", param_hint="STEP")
    n, k = sizes
    cfg, params = models.model(model)
    dev = captured_step(cfg, params, kind, int(n), int(k), np.random.default_rng(0))
    dev.time(5)
    untraced = dev.time(iters)  # the engine's own compiled program
    assert dev.captured is not None  # captured_step captured it
    _, fn, static, rest = dev.captured
    traced = compile_transition(fn, static, (dev.engine.pool, *rest), TRACEME)
    ops = instructions(traced.as_text())
    dev.time(5, traced)
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            traced_s = dev.time(iters, traced)  # iters + 1 runs
        totals = thunk_totals(Path(tmp))
    per_run = {name: us / (iters + 1) for name, us in totals.items() if name in ops}
    times = f"{untraced * 1e3:.3f} ms untraced, {traced_s * 1e3:.3f} ms traced (median of {iters})"
    print(f"{model} {kind} n={n} K={k}: {times}")
    print(f"  top-level ops: {len(ops)}, traced time {sum(per_run.values()) / 1e3:.3f} ms per run")
    for name, us in sorted(per_run.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {us:9.1f} us  {name:36s} {ops[name][:120]}")
