"""Section `compile`: time to first step and compilations of a ragged verify loop, for the
tiny model and for the 48-layer Qwen3-Next pattern (tiny width), in the scan layout and unrolled.

Owns: `ragged_verify_loop` (the benchmark's own scheduler loop: propose, ragged verify, the
verdict by `Engine.accept`; K per sequence cycles through a ragged pattern and the verdicts are
forced, so every step has the same shapes but different K and acceptances), `measure` (one
engine from construction through the loop) and `run` (every case, each in a fresh process by
default so "first step" means a cold process's first step).

Layouts (`Engine(..., layout=)`): `scan` stacks the periodic layer groups and loops over one group
body; `unrolled` is the engine's `list` layout, one parameter tree per layer, every layer in the
program. A model whose period is its layer count (the tiny preset) has one layout only.

Zero recompiles after warm-up: the loop reports the engine's compilations and JAX's backend
compilations after its warm-up steps; `tests/test_benchmarks.py` asserts both stay unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import click
import numpy as np

from benchmarks import models
from benchmarks.settings import Settings
from benchmarks.timing import CompileCounter, Stats
from metrale_jax.engine.engine import Engine
from metrale_jax.model.layer_groups import layer_period

#: The benchmark's layout names -> the engine's.
ENGINE_LAYOUTS = {"scan": "scan", "unrolled": "list"}
PATTERN = ((4, 2, 3), (2, 2, 2), (3, 4, 1))  # K per sequence, cycled; clipped to each slot's capacity
N_SEQS = 3
PROMPT_LEN = 21


class ProgramTimer:
    """Wraps `engine.programs.run`: the wall seconds of every call that compiled a program
    (trace + lower + compile + that first run), by program name, in order."""

    def __init__(self, engine: Engine):
        self.compiled: list[tuple[str, float]] = []
        programs = engine.programs
        orig = programs.run

        def run(name, fn, static, *args):
            before = programs.compilations
            t0 = time.perf_counter()
            out = orig(name, fn, static, *args)
            if programs.compilations > before:
                self.compiled.append((name, time.perf_counter() - t0))
            return out

        programs.run = run  # type: ignore[method-assign]  # this engine's calls only, not the class's


def ragged_verify_loop(
    engine: Engine,
    prompts,
    steps: int,
    *,
    warmup: int = 3,
    counter: CompileCounter | None = None,
    max_len: int | None = None,
) -> dict:
    """Prefill `prompts`, then `steps` speculative steps over them: propose (MTP), verify with
    ragged K, the verdict (`Engine.accept`: stash the accepted rows' hiddens, fold, rewind,
    commit). Acceptances are forced ((step + i) % K), so the loop exercises partial, zero and
    full acceptance. A sequence past
    `max_len` tokens is rewound to its prompt (host-only, as the engine allows).

    Returns seconds (prefill, each step), the engine's compilations after the prefill, after the
    first step, after `warmup` steps and at the end, and JAX backend compilations after warm-up
    (needs `counter`, which is reset at the end of warm-up)."""
    kmax = engine.counts.k
    max_len = max_len or engine.settings.max_seq_len - 2 * kmax - 2
    seqs = [engine.alloc_sequence() for _ in prompts]
    out: dict[str, Any] = {"step_s": []}
    try:
        t0 = time.perf_counter()
        last = [int(np.argmax(engine.prefill(s, p))) for s, p in zip(seqs, prompts)]
        out["prefill_s"] = time.perf_counter() - t0
        out["compilations_after_prefill"] = engine.programs.compilations
        for step in range(steps):
            t0 = time.perf_counter()
            caps = [engine.counts.slot_draft_capacity(s.slot) + 1 for s in seqs]
            ks = [max(1, min(PATTERN[step % len(PATTERN)][i % N_SEQS], kmax, c)) for i, c in enumerate(caps)]
            drafts, _, _ = engine.propose_batched(seqs, last, kmax - 1, logits=False)
            for s in seqs:
                engine.trim_proposer(s)
            rows = [[last[i], *[int(x) for x in drafts[i, : ks[i] - 1]]] for i in range(len(seqs))]
            _, argmax = engine.verify_batched(seqs, [t for r in rows for t in r], ks)
            off = np.concatenate([[0], np.cumsum(ks)])
            na = [(step + i) % k for i, k in enumerate(ks)]
            engine.accept(seqs, na)
            last = [int(argmax[off[i] + a]) for i, a in enumerate(na)]
            for s, p in zip(seqs, prompts):
                if s.seq_len > max_len:
                    engine.blocks.rewind(s, s.seq_len - len(p))
            out["step_s"].append(time.perf_counter() - t0)
            if step == 0:
                out["compilations_after_first_step"] = engine.programs.compilations
            if step + 1 == warmup:
                out["compilations_after_warmup"] = engine.programs.compilations
                if counter is not None:
                    counter.reset()
        out["compilations_end"] = engine.programs.compilations
        out["backend_compiles_after_warmup"] = counter.count if counter is not None else None
        return out
    finally:
        for s in reversed(seqs):
            engine.free_sequence(s)


def measure(model_name: str, layout: str, steps: int, *, num_drafts: int = 3, seed: int = 0) -> dict:
    """One case from a fresh engine: construction, prefill of N_SEQS prompts, the loop."""
    cfg, params = models.model(model_name)
    period = layer_period(cfg)
    groups = cfg.num_hidden_layers // period
    if layout not in ENGINE_LAYOUTS:
        raise ValueError(f"layout must be scan or unrolled, got {layout!r}")
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, cfg.vocab_size, PROMPT_LEN).tolist() for _ in range(N_SEQS)]
    with CompileCounter() as counter:
        t0 = time.perf_counter()
        settings = models.settings(max_batch_size=4, max_seq_len=256, speculative=True, num_drafts=num_drafts)
        engine = Engine(cfg, params, settings, layout=ENGINE_LAYOUTS[layout])
        init_s = time.perf_counter() - t0
        timer = ProgramTimer(engine)
        loop = ragged_verify_loop(engine, prompts, steps, counter=counter)
        backend_total = counter.seconds
    steady = Stats.of(loop["step_s"][3:] or loop["step_s"][-1:])
    return {
        "model": model_name,
        "layers": cfg.num_hidden_layers,
        "period": period,
        "groups": groups,
        "layout": layout if groups > 1 else "single group (scan = unrolled)",
        "steps": steps,
        "engine_init_s": init_s,
        "prefill_first_s": loop["prefill_s"],
        "first_step_s": loop["step_s"][0],
        # From a constructed engine: its prefill, then the loop's first step (both compile). The
        # engine's construction (which stacks the layer groups of the scan layout) is apart.
        "time_to_first_step_s": loop["prefill_s"] + loop["step_s"][0],
        "steady_step": steady.__dict__,
        "programs": [{"name": n, "compile_s": s} for n, s in timer.compiled],
        "compilations": loop["compilations_end"],
        "compilations_after_first_step": loop["compilations_after_first_step"],
        "compilations_after_warmup": loop["compilations_after_warmup"],
        "recompiles_after_warmup": loop["compilations_end"] - loop["compilations_after_warmup"],
        "backend_compiles_after_warmup": loop["backend_compiles_after_warmup"],
        "backend_compile_s_in_warmup": backend_total,
    }


def cases_for(models_: list[str]) -> list[tuple[str, str]]:
    """(model, layout) pairs: both layouts where the model has more than one layer group."""
    out = []
    for m in models_:
        cfg = models.config(m)
        many = cfg.num_hidden_layers // layer_period(cfg) > 1
        out += [(m, "scan"), (m, "unrolled")] if many else [(m, "scan")]
    return out


def run(s: Settings, *, log=print) -> dict:
    """Every (model, layout) case of `s.compile_models` `s.compile_repeats` times, a loop of
    `s.compile_steps` steps each; layouts alternate order between repeats. With `s.isolate`, each
    measurement runs in a fresh `python -m benchmarks.compile_cost` process."""
    steps, repeats, isolate = s.compile_steps, s.compile_repeats, s.isolate
    cases = cases_for(s.compile_models)
    results: dict[tuple[str, str], list[dict]] = {c: [] for c in cases}
    for r in range(repeats):
        order = cases if r % 2 == 0 else list(reversed(cases))
        for m, layout in order:
            res = _isolated(m, layout, steps) if isolate else measure(m, layout, steps)
            log(
                f"compile {m} {res['layout']}: first step after {res['time_to_first_step_s']:.1f} s, "
                f"{res['compilations']} compilations, {res['recompiles_after_warmup']} after warm-up"
            )
            results[(m, layout)].append(res)
    rows = []
    for (m, _), runs in results.items():
        summary = {
            k: Stats.of([x[k] for x in runs]).__dict__
            for k in ("time_to_first_step_s", "engine_init_s", "prefill_first_s", "first_step_s")
        }
        prog: dict[str, list[float]] = {}
        for x in runs:
            for p in x["programs"]:
                prog.setdefault(p["name"], []).append(p["compile_s"])
        rows.append(
            {
                "model": m,
                "layout": runs[0]["layout"],
                "layers": runs[0]["layers"],
                "groups": runs[0]["groups"],
                "compilations": sorted({x["compilations"] for x in runs}),
                "recompiles_after_warmup": max(x["recompiles_after_warmup"] for x in runs),
                "backend_compiles_after_warmup": max(x["backend_compiles_after_warmup"] or 0 for x in runs),
                "steady_step_ms": 1e3 * Stats.of([x["steady_step"]["median"] for x in runs]).median,
                "program_compile_s": {k: Stats.of(v).__dict__ for k, v in prog.items()},
                **summary,
                "runs": runs,
            }
        )
    return {"steps": steps, "repeats": repeats, "isolated": isolate, "cases": rows}


def _isolated(model_name: str, layout: str, steps: int) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.compile_cost",
            "--model",
            model_name,
            "--layout",
            layout,
            "--steps",
            str(steps),
        ],
        capture_output=True,
        text=True,
        cwd=root,
        env=env,
    )
    if r.returncode != 0:
        raise RuntimeError(f"compile case {model_name}/{layout} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


@click.command(help="One compile-cost case in this process (its JSON on the last stdout line).")
@click.option("--model", required=True)
@click.option("--layout", type=click.Choice(["scan", "unrolled"]), default="scan")
@click.option("--steps", type=int, default=50)
def main(model: str, layout: str, steps: int) -> None:
    print(json.dumps(measure(model, layout, steps)))


if __name__ == "__main__":
    main()
