"""Section `slots`: a one-sequence step's device time against the number of slots the engine holds.

Why it exists: every program takes the engine's pool donated and must update it in place. When
XLA cannot order a read of a pool buffer before its in-place write, it copies the whole buffer
(every layer, every slot) instead, and the step's cost then grows with the slot count, not with
the work.
This section shows that growth, or its absence: one engine per slot count, one sequence of `ctx`
tokens, its decode and its verify of K rows timed as compiled programs alone (`DeviceStep`), and
the programs' `pool_copies` (copies of a whole pool leaf; 0 when the pool is updated in place).
"""

from __future__ import annotations

import functools

import numpy as np

from benchmarks import models
from benchmarks.settings import Settings
from benchmarks.steps import DeviceStep, StepBench, max_seq_len_for


def run(s: Settings) -> dict:
    """The section at `s.slots_model`: one engine per slot count of `s.slot_counts`, one sequence of
    `s.ctx` tokens, its decode and its verify of k rows (`s.step_shape`), each timed over `s.slots_iters` runs."""
    model_name, ctx, k, iters = s.slots_model, s.ctx, s.step_shape[1], s.slots_iters
    cfg, params = models.model(model_name)
    rng = np.random.default_rng(s.seed)
    prompt = rng.integers(0, cfg.vocab_size, size=(1, ctx)).tolist()
    rows = rng.integers(0, cfg.vocab_size, size=(1, k)).tolist()
    out = []
    for slots in s.slot_counts:
        bench = StepBench.verifying(cfg, params, max_batch=slots, max_seq_len=max_seq_len_for(ctx + k), k=k)
        bench.context("c", prompt)
        decode_s = DeviceStep.capture(bench.engine, functools.partial(bench.decode, "c", rows[0][:1]))[0].time(iters)
        verify_s = DeviceStep.capture(bench.engine, functools.partial(bench.verify, "c", rows))[0].time(iters)
        trunk = bench.engine.pool.trunk
        out.append(
            {
                "slots": slots,
                "decode_s": decode_s,
                "verify_s": verify_s,
                "gdn_state_bytes": sum(int(x.nbytes) for x in (trunk.gdn_h, trunk.gdn_conv) if x is not None),
                "pool_copies": {i.name: i.pool_copies for i in bench.engine.programs.info.values()},
            }
        )
    return {"model": model_name, "context_tokens": ctx, "k": k, "iters": iters, "rows": out}
