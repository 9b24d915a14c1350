"""Section `gap`: what an idle gap before a call costs the engine's verify step.

Why it exists: the `hf` section's call-by-call timing starts every engine call after HF's turn,
and on a shared VM a step that follows an idle gap is slower (the core and its caches go cold).
This section measures that cost on the engine alone, so the call-by-call and back-to-back
columns of `hf` can be read against it.

One engine, one verify step (n sequences x K rows over a `ctx`-token context, rolled back after
each call); for each gap (seconds slept before every call; 0 = back to back) `calls` timed calls,
their median; `rounds` rounds with the gaps in turn, and the best median of the rounds per gap
(the machine's phase changes within minutes, so the least disturbed round is the comparable one).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from benchmarks import models
from benchmarks.settings import Settings
from benchmarks.steps import StepBench, max_seq_len_for


def run(s: Settings) -> dict:
    """The section at `s.model`: n sequences x k rows (`s.step_shape`) over `s.ctx` tokens, after
    `s.warmup` untimed calls; `s.gap_calls` calls per gap of `s.gaps_ms` in each of `s.gap_rounds` rounds."""
    model_name, ctx, calls, rounds, (n, k) = s.model, s.ctx, s.gap_calls, s.gap_rounds, s.step_shape
    gaps = [ms / 1e3 for ms in s.gaps_ms]
    cfg, params = models.model(model_name)
    rng = np.random.default_rng(s.seed)
    bench = StepBench.verifying(cfg, params, max_batch=n, max_seq_len=max_seq_len_for(ctx + k), k=k)
    bench.context("c", rng.integers(0, cfg.vocab_size, size=(n, ctx)).tolist())
    rows = rng.integers(0, cfg.vocab_size, size=(n, k)).tolist()
    for _ in range(s.warmup + 1):
        bench.verify("c", rows)
    medians: dict[float, list[float]] = {g: [] for g in gaps}
    for _ in range(rounds):
        for g in gaps:
            secs = []
            for _ in range(calls):
                if g:
                    time.sleep(g)
                secs.append(bench.verify("c", rows)[0])
            medians[g].append(statistics.median(secs))
    return {
        "model": model_name,
        "n": n,
        "k": k,
        "context_tokens": ctx,
        "calls": calls,
        "rounds": rounds,
        "gaps": [{"gap_s": g, "best_median_s": min(m), "round_medians_s": m} for g, m in medians.items()],
    }
