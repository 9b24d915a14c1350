"""Section `forwards`: the `pallas` forward against `xla` on the same engine step, as a ratio.

One speculative engine; `Engine.set_forward` switches the forward between calls (programs are
cached per forward, so both stay compiled) and the two are alternated call by call. On a CPU the
kernels run under the Pallas interpreter (a correctness vehicle, not a fast path), so the ratio
says what the interpreter costs; on a GPU the same section times the Triton kernels.

Steps: a prefill of T tokens, a decode step of n sequences and a verify step of n x K, the last
two over a context of `ctx` tokens. Also reported: each forward's first call (compile), the
largest |pallas - xla| logit of the first calls, and the shapes the kernels refused.
"""

from __future__ import annotations

import sys

import numpy as np

from benchmarks import models
from benchmarks.settings import Settings
from benchmarks.steps import StepBench, max_seq_len_for
from benchmarks.timing import paired
from kernels_pallas.ops import PallasOps


def run(s: Settings) -> dict:
    """The section at `s.model`: T = the first of `s.prefill_lens` (at least 16), n, k of
    `s.step_shape`, `s.ctx`; `s.repeats` alternated pairs after `s.warmup`; the steps of `s.forward_steps`."""
    model_name, prefill_len, ctx, (n, k) = s.model, max(s.prefill_lens[0], 16), s.ctx, s.step_shape
    cfg, params = models.model(model_name)
    rng = np.random.default_rng(s.seed)
    rand = lambda *shape: rng.integers(0, cfg.vocab_size, size=shape).tolist()  # noqa: E731
    max_seq_len = max_seq_len_for(max(prefill_len, ctx + k + 2))
    bench = StepBench.verifying(cfg, params, max_batch=2 * n + 1, max_seq_len=max_seq_len, k=k)
    eng = bench.engine
    # Two identical contexts: each forward's first call sees the same state (a decode step
    # advances the GDN state; only its length is rewound).
    prompts = rand(n, ctx)
    for fwd in ("xla", "pallas"):
        bench.context(fwd, prompts)
    prompt, step, rows = rand(prefill_len), rand(n), rand(n, k)
    calls = {
        "prefill": lambda c: bench.prefill(prompt),
        "decode": lambda c: bench.decode(c, step),
        "verify": lambda c: bench.verify(c, rows),
    }
    shapes = {"prefill": (1, prefill_len), "decode": (n, 1), "verify": (n, k)}
    steps = [step for step in calls if step in s.forward_steps]
    # First calls of every step on both forwards before any timing (on its own context, each
    # forward sees the same state), then the alternated timings (all on the xla context).
    first, logits = {}, {}
    for name in steps:
        for fwd in ("xla", "pallas"):
            eng.set_forward(fwd)
            first[(name, fwd)], logits[(name, fwd)] = calls[name](fwd)
    out = []
    for name in steps:

        def on(fwd, call=calls[name]):
            def go():
                eng.set_forward(fwd)
                return call("xla")[0]

            return go

        pal, xla, ratio = paired(on("pallas"), on("xla"), s.repeats, s.warmup)
        diff = float(np.abs(np.asarray(logits[(name, "pallas")]) - np.asarray(logits[(name, "xla")])).max())
        row = {
            "step": name,
            "n": shapes[name][0],
            "t": shapes[name][1],
            "pallas": pal.__dict__,
            "xla": xla.__dict__,
            "ratio": ratio.__dict__,
            "ratio_of_medians": pal.median / xla.median,
            "first_call_s": {f: first[(name, f)] for f in ("pallas", "xla")},
            "max_abs_diff": diff,
        }
        print(
            f"[bench forwards] {name}: pallas {pal.ms()} ms, xla {xla.ms()} ms, ratio {row['ratio_of_medians']:.2f}",
            file=sys.stderr,
            flush=True,
        )
        out.append(row)
    eng.set_forward("xla")
    return {
        "model": model_name,
        "context_tokens": ctx,
        "interpret": PallasOps().interpret,
        "refusals": eng.disclosure("pallas")["refusals"],
        "launches_per_step": {f: eng.disclosure(f)["launches_per_step"] for f in ("xla", "pallas")},
        "cases": out,
    }
