"""Probe `moe-forms`: the routed MoE block's three forms side by side at given row counts, in one process: one MoE
layer of a benchmark model (random weights, laid out as the single-device engine holds them: `backend_layout`) on
random rows, `mlp.moe` with its form forced to each of `pairs`, `dense`, `grouped`, alternated round by round; which
form `mlp.moe_form` picks is printed with the times. For the thresholds in `mlp` (a form's crossover moves with the
widths and the expert count).

    .venv/bin/python -m benchmarks moe-forms [MODEL] [ROWS ...]

MODEL: a `metrale_jax.model_registry.config` name (default qwen3-next-h512); ROWS: row counts (default 8 16 24 32 40
64). Pinned to one core; per form the median of ROUNDS (15) means of REPS (5) calls, in ms."""

import time

import click
import jax
import numpy as np

from metrale_jax.model import mlp
from metrale_jax.model.weight_layout import backend_layout
from metrale_jax.model_registry import config
from metrale_jax.params import init_params

ROUNDS, REPS = 15, 5
FORMS = ("pairs", "dense", "grouped")


@click.command("moe-forms", help="The routed MoE block's three forms side by side at given row counts (ms).")
@click.argument("name", metavar="[MODEL]", default="qwen3-next-h512")
@click.argument("row_counts", metavar="[ROWS...]", nargs=-1, type=int)
def command(name: str, row_counts: tuple[int, ...]) -> None:
    cfg = config(name)
    layer = next(layer["mlp"] for layer in init_params(cfg, 3)["layers"] if mlp.is_moe_block(layer["mlp"]))
    w = backend_layout({"mlp": layer}, cfg, None)["mlp"]
    leaves = mlp.expert_leaves_apply(cfg)
    for rows in row_counts or (8, 16, 24, 32, 40, 64):
        x = jax.random.normal(jax.random.key(rows), (1, rows, cfg.hidden_size))
        programs = {
            form: jax.jit(lambda w, x, form=form: mlp.moe(w, x, cfg, form)).lower(w, x).compile() for form in FORMS
        }
        times: dict = {form: [] for form in FORMS}
        for program in programs.values():
            program(w, x).block_until_ready()
        for _ in range(ROUNDS):
            for form, program in programs.items():
                start = time.perf_counter()
                for _ in range(REPS):
                    program(w, x).block_until_ready()
                times[form].append((time.perf_counter() - start) / REPS * 1e3)
        ms = {form: round(float(np.median(t)), 3) for form, t in times.items()}
        print(f"{name} rows {rows} (picks {mlp.moe_form(rows, cfg, leaves)}): {ms}", flush=True)
