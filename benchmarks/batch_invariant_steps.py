"""Step times of the 45 M model (`qwen3-next-h512`) in the default mode and under --batch-invariant, side by side.

Owns: `main` (both modes, each in a process of its own: the mode's FMA pin, `runtime_env.FMA_PIN_FLAG`, is a
process flag that would change the default mode's programs too) and `measure` (one mode's medians, in ms, of a
prefill of 1024 tokens, a decode of n = 1 and n = 8 and a verify of n = 8 x K = 4).

Run: `python -m benchmarks.batch_invariant_steps` (prints one line per step: default ms, invariant ms, ratio).
Not yet a `make bench` section.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from metrale_jax.runtime_env import FMA_PIN_FLAG


def measure(invariant: bool) -> dict[str, float]:
    import numpy as np

    from benchmarks.models import model
    from benchmarks.steps import StepBench, max_seq_len_for

    cfg, params = model("qwen3-next-h512")
    rng = np.random.default_rng(0)

    def tok(n: int) -> list[int]:
        return [int(x) for x in rng.integers(0, cfg.vocab_size, size=n)]

    def med(f, n: int) -> float:
        f()  # compiles
        return statistics.median([f() for _ in range(n)]) * 1e3

    out = {}
    b = StepBench(cfg, params, max_batch=9, max_seq_len=max_seq_len_for(1100), batch_invariant=invariant)
    out["prefill 1024"] = med(lambda: b.prefill(tok(1024))[0], 2)
    b.context("c8", [tok(64) for _ in range(8)])
    b.context("c1", [tok(64)])
    out["decode n=1"] = med(lambda: b.decode("c1", [1])[0], 15)
    out["decode n=8"] = med(lambda: b.decode("c8", list(range(8)))[0], 15)
    v = StepBench.verifying(cfg, params, max_batch=8, max_seq_len=max_seq_len_for(200), k=4, batch_invariant=invariant)
    v.context("c8", [tok(64) for _ in range(8)])
    out["verify n=8 K=4"] = med(lambda: v.verify("c8", [tok(4) for _ in range(8)])[0], 10)
    return out


def _run(invariant: bool) -> dict[str, float]:
    env = dict(os.environ)
    if invariant:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {FMA_PIN_FLAG}".strip()
    code = f"import json; from benchmarks.batch_invariant_steps import measure; print(json.dumps(measure({invariant})))"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    base, inv = _run(False), _run(True)
    for step in base:
        print(f"{step:16s} default {base[step]:9.2f} ms  invariant {inv[step]:9.2f} ms  {inv[step] / base[step]:.2f}x")


if __name__ == "__main__":
    main()
