"""Probe `layout-ab`: the single-device CPU engine's weight layouts and its rows kernel side by side, in one process:
each step's program with the weights as the engine holds them (`backend_layout`: input-major, and one leaf per
expert where `mlp.expert_leaves_apply`), the same with the products of 2-32 rows on XLA's dot instead of the rows
kernel (`kernels_cpu.rows_matmul`), input-major with the expert stacks kept whole, and in the checkpoints' [out,
in], alternated round by round.

    .venv/bin/python -m benchmarks layout-ab [MODEL] [STEP ...] [--rounds 3] [--reps 10]

MODEL: a `benchmarks.models.model` name (default qwen3-next-h512); STEP: kind:n:k, a decode of n sequences
(k = 1), a verify of n sequences of K = k rows, a fused speculative step (a verify of K = k rows, then k - 1
drafts), or a prefill of one sequence of k tokens (default: prefill 128,
decode n = 1 and 8, verify K = 4 at n = 1 and 8). Pinned to one core; decode and verify time the compiled
program alone (`step_times.captured_step`), a prefill the engine call; per layout the least of ROUNDS
medians of REPS calls, and in parentheses its time over the engine's layout's.

NOTE: the layouts are swapped by replacing `metrale_jax.engine.engine.backend_layout`, the function the
engine places its weights with, for the engines this probe builds.
"""

import os

import click
import numpy as np

import metrale_jax.engine.placement as placement
from benchmarks import models
from benchmarks.probes.step_times import captured_step
from benchmarks.steps import StepBench, max_seq_len_for
from kernels_cpu.rows_matmul.api import DISABLE_ENV
from metrale_jax.model.linear import transpose_weights

ENGINE = "engine's"
NO_ROWS_KERNEL = "engine's, XLA's dot"
LAYOUTS = {
    ENGINE: placement.backend_layout,
    NO_ROWS_KERNEL: placement.backend_layout,
    "[in, out] stacked": lambda params, cfg, mesh: transpose_weights(params),
    "[out, in]": lambda params, cfg, mesh: params,
}
# How a step's k reads in the report.
STEP_SIZE = {"prefill": " tokens=", "decode": " K=", "verify": " K=", "fused": " K="}
DEFAULT_STEPS = ["prefill:1:128", "decode:1:1", "decode:8:1", "verify:1:4", "verify:8:4"]


def parse_step(text: str) -> tuple[str, int, int]:
    """kind:n:k -> (kind, n, k)."""
    kind, n, k = text.split(":")
    return kind, int(n), int(k)


def timer(cfg, params, kind: str, n: int, k: int, rng):
    """A callable that runs the step once and returns its seconds, for an engine built now."""
    if kind == "prefill":
        bench = StepBench(cfg, params, max_batch=1, max_seq_len=max_seq_len_for(k))
        tokens = rng.integers(0, cfg.vocab_size, k).tolist()
        bench.prefill(tokens)
        return lambda: bench.prefill(tokens)[0]
    dev = captured_step(cfg, params, kind, n, k, rng)
    dev.time(5)
    return lambda: dev.time(1)


@click.command("layout-ab", help="The CPU engine's weight layouts and its rows kernel side by side (ms).")
@click.argument("name", metavar="[MODEL]", default="qwen3-next-h512")
@click.argument("step_texts", metavar="[STEP...]", nargs=-1)
@click.option("--rounds", default=3, show_default=True, help="alternated rounds (the least median is kept)")
@click.option("--reps", default=10, show_default=True, help="calls per round (their median)")
def command(name: str, step_texts: tuple[str, ...], rounds: int, reps: int) -> None:
    steps = [parse_step(s) for s in step_texts or DEFAULT_STEPS]
    cfg, params = models.model(name)
    rng = np.random.default_rng(0)
    for kind, n, k in steps:
        timers = {}
        for layout, place in LAYOUTS.items():
            placement.backend_layout = place
            if layout == NO_ROWS_KERNEL:
                os.environ[DISABLE_ENV] = "0"  # read when the engine's programs are traced (in `timer`)
            try:
                timers[layout] = timer(cfg, params, kind, n, k, rng)
            finally:
                placement.backend_layout = LAYOUTS[ENGINE]
                os.environ.pop(DISABLE_ENV, None)
        best = {layout: float("inf") for layout in LAYOUTS}
        for _ in range(rounds):
            for layout, run in timers.items():
                best[layout] = min(best[layout], float(np.median([run() for _ in range(reps)])) * 1e3)
        held = best[ENGINE]
        others = ", ".join(f"{layout} {ms:.3f} ms ({ms / held:.2f})" for layout, ms in best.items() if layout != ENGINE)
        print(f"{name} {kind} n={n}{STEP_SIZE[kind]}{k}: engine's {held:.3f} ms; {others}", flush=True)
