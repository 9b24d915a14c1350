"""Section `anatomy`: where a generation step's time goes, program by program, and what this CPU's matrix
products can reach at a step's row counts.

Owns: `run` (two tables' worth of figures) and `dot_sweep`.

Programs: on `anatomy_model` (`small` by default: the preset whose e2e rows the section explains), one
greedy engine and one speculative engine per draft count d, each driven through a prefill and one call of
every program a generation step runs: greedy decode; the fused speculative step with d drafts; the composed
path's verify of K = d + 1 rows, stash, fold, commit and its propose of d drafts. Per program: the launches
of XLA's entry computation (`ProgramInfo.launches`) and the compiled program alone re-run on its captured
arguments (`steps.DeviceStep`: median over `anatomy_iters` calls after one, pool donated and fed back), so
the time per launch shows whether a step is bound by its work or by the number of kernels it runs.

Products: `dot_sweep` times `x [M, in] @ w [out, in]^T` in both weight layouts (the checkpoint's [out, in], and
the input-major [in, out] the single-device CPU engine runs, `linear.TransposedWeight`) at the realistic-width model's
largest expert projection (`anatomy_dot_model`, the 45 M model by default: all experts' gate/up rows, as the
`dense` MoE form runs them) for each M, over enough distinct weight matrices that every call reads its weight
from memory, not from the cache (the regime of a real step), and in cache (one matrix, re-read): GB/s of
weight read per call. A step's floor in bytes / bandwidth assumes the products stream at the read bandwidth;
these figures are what XLA's products reach at that M.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import models
from benchmarks.settings import Settings
from benchmarks.steps import DeviceStep
from metrale_jax.engine.engine import Engine
from metrale_jax.model.linear import TransposedWeight, linear

# Distinct weights cycled per timed call in the out-of-cache sweep: their total is several times any L3.
OUT_OF_CACHE_BYTES = 96 << 20


def _timed(engine: Engine, name: str, call: Callable[[], object], iters: int) -> dict:
    """Run `call` (it runs program `name` once, compiling it when new) and time that program alone."""
    dev, _ = DeviceStep.capture(engine, call, name)
    info = [i for k, i in engine.programs.info.items() if k[0] == name][-1]
    secs = dev.time(iters)
    return {"program": name, "launches": info.launches, "device_s": secs, "us_per_launch": 1e6 * secs / info.launches}


def _undone(seq, call: Callable[[], object]) -> Callable[[], None]:
    """`call`, then the sequence's host bookkeeping put back (length, tokens, drafter length): every
    timed call runs at the same positions and addresses (the device state's values drift, never its
    shapes)."""

    def run() -> None:
        saved = (seq.seq_len, list(seq.tokens), seq.drafter_len)
        call()
        seq.seq_len, seq.tokens, seq.drafter_len = saved

    return run


def _speculative(cfg, params, d: int, iters: int, prompt: list[int], base: dict) -> list[dict]:
    """The rows of a speculative engine with num_drafts = d: the fused step and the composed path's programs."""
    eng = Engine(cfg, params, models.settings(**base, speculative=True, num_drafts=d))
    seq = eng.alloc_sequence()
    eng.prefill(seq, prompt)
    k, flat, label = d + 1, [1] * (d + 1), f"speculative d={d}"

    def verdict() -> None:
        eng.verify_batched([seq], flat, [k])
        eng.accept([seq], [0])

    fused = _undone(seq, lambda: eng.speculative_step([seq], flat, [k], d))
    verify = _undone(seq, verdict)
    propose = _undone(seq, lambda: eng.propose_batched([seq], [1], d, logits=False))
    rows = [
        {"engine": label, "step": f"fused step, K={k}", **_timed(eng, "speculative_step", fused, iters)},
        {"engine": label, "step": f"verify, K={k}", **_timed(eng, "step_rows", verify, iters)},
    ]
    for name in ("stash_rows", "gdn_fold", "commit_conv"):
        rows.append({"engine": label, "step": name, **_timed(eng, name, verify, iters)})
    rows.append({"engine": label, "step": f"propose, {d} drafts", **_timed(eng, "propose", propose, iters)})
    return rows


def _programs(cfg, params, drafts: list[int], iters: int, prompt: list[int]) -> list[dict]:
    """One row per program a step runs (see the module docstring)."""
    base = dict(max_batch_size=1, max_seq_len=256)
    greedy = Engine(cfg, params, models.settings(**base))
    seq = greedy.alloc_sequence()
    greedy.prefill(seq, prompt)
    decode = _undone(seq, lambda: greedy.decode_batch([seq], [1]))
    rows = [{"engine": "greedy", "step": "decode", **_timed(greedy, "step_rows", decode, iters)}]
    for d in drafts:
        rows += _speculative(cfg, params, d, iters, prompt, base)
    return rows


def _per_call(prod, x, weights: list) -> float:
    """Seconds per product of `x` with each of `weights` in turn."""
    t0 = time.perf_counter()
    for w in weights:
        prod(x, w).block_until_ready()
    return (time.perf_counter() - t0) / len(weights)


def dot_sweep(out_dim: int, in_dim: int, ms: list[int], repeats: int) -> list[dict]:
    """GB/s of weight read by `linear(x [M, in], w)` for each weight layout ([out, in]; [in, out]) and M: out of
    cache (distinct weights per call) and in cache (one weight re-read)."""
    per = out_dim * in_dim * 4
    count = max(2, OUT_OF_CACHE_BYTES // per)
    keys = jax.random.split(jax.random.key(0), count)
    plain = [jax.random.normal(k, (out_dim, in_dim), jnp.float32) for k in keys]
    prod = jax.jit(linear)
    out = []
    for layout, weights in (("[out, in]", plain), ("[in, out]", [TransposedWeight.of(w) for w in plain])):
        for m in ms:
            x = jax.random.normal(jax.random.key(m), (m, in_dim), jnp.float32)
            for w in weights[:2]:
                prod(x, w).block_until_ready()

            cold = statistics.median(_per_call(prod, x, weights) for _ in range(repeats))
            warm = statistics.median(_per_call(prod, x, [weights[0]] * count) for _ in range(repeats))
            out.append(
                {
                    "layout": layout,
                    "m": m,
                    "cold_s": cold,
                    "warm_s": warm,
                    "cold_gb_s": per / cold / 1e9,
                    "warm_gb_s": per / warm / 1e9,
                }
            )
        del weights
    return out


def run(s: Settings) -> dict:
    """The section from the `anatomy_*` fields of `s` (see the module docstring)."""
    cfg, params = models.model(s.anatomy_model)
    rng = np.random.default_rng(s.seed)
    prompt = rng.integers(0, cfg.vocab_size, s.e2e_prompt_len).tolist()
    rows = _programs(cfg, params, s.anatomy_drafts, s.anatomy_iters, prompt)
    wide = models.config(s.anatomy_dot_model)
    shape = (wide.num_experts * 2 * wide.moe_intermediate_size, wide.hidden_size)
    return {
        "model": s.anatomy_model,
        "programs": rows,
        "dot_model": s.anatomy_dot_model,
        "dot_shape": list(shape),
        "dots": dot_sweep(*shape, s.anatomy_ms, s.anatomy_repeats),
    }
