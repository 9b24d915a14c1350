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
from benchmarks.steps import StepBench, max_seq_len_for


def run(
    model_name: str, *, n: int, k: int, ctx: int, gaps, calls: int, rounds: int, warmup: int, seed: int = 0
) -> dict:
    cfg, params = models.model(model_name)
    rng = np.random.default_rng(seed)
    bench = StepBench(
        cfg,
        params,
        max_batch=n,
        max_seq_len=max_seq_len_for(ctx + k),
        speculative=True,
        num_drafts=k - 1,
        mtp_k_ladder=f"{n}:{k - 1}",
    )
    bench.context("c", rng.integers(0, cfg.vocab_size, size=(n, ctx)).tolist())
    rows = rng.integers(0, cfg.vocab_size, size=(n, k)).tolist()
    for _ in range(warmup + 1):
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
