"""Section `invariant`: the engine's step times in the default mode and under --batch-invariant, side by side.

Owns: `run` (the section: per model, the two modes' medians and ratios; `python -m benchmarks invariant`),
`compare` (one model's rows), `worker` (one mode's engines in a process of its own, timing a round of every step
when asked; `main` starts it).

Steps (`STEPS`): a decode of n = 1 and of n = 8 sequences, a verify of n = 8 sequences x K = 4 rows, a prefill
of `prefill_len` tokens in one chunk; each an engine call (`benchmarks.steps.StepBench`: host bookkeeping and
the logits' copy included, the same work in both modes), after contexts of `ctx` tokens.

Invariants:
- Each mode runs in a process of its own: the mode's FMA pin (`runtime_env.FMA_PIN_FLAG`) is a process flag
  that would change the default mode's programs too. Both processes compile first, then take turns: a round
  asks each for `calls` calls of every step (which goes first alternates), so both modes see the same load;
  a mode's time is the median of its round medians, the ratio the median of the rounds' ratios.
- Both modes run the same weights, contexts and tokens (the same seed).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import IO

from benchmarks.settings import Settings
from metrale_jax.runtime_env import FMA_PIN_FLAG

STEPS = ("decode n=1", "decode n=8", "verify n=8 K=4", "prefill")
_N, _K = 8, 4  # the wider decode's and the verify's sequences, the verify's rows per sequence


def _steps(model: str, prefill_len: int, ctx: int, invariant: bool, seed: int) -> dict:
    """Step name -> a function that runs the step once and returns its seconds (engines built, nothing compiled)."""
    import numpy as np

    from benchmarks.models import model as load
    from benchmarks.steps import StepBench, max_seq_len_for

    cfg, params = load(model)
    rng = np.random.default_rng(seed)

    def tokens(n: int) -> list[int]:
        return [int(x) for x in rng.integers(0, cfg.vocab_size, size=n)]

    prompt = tokens(prefill_len)
    length = max_seq_len_for(max(prefill_len, ctx + _K))
    # slots: the contexts of 1 and of _N sequences, and the prefill's own
    b = StepBench(cfg, params, max_batch=_N + 2, max_seq_len=length, batch_invariant=invariant)
    b.context("c1", [tokens(ctx)])
    b.context("c8", [tokens(ctx) for _ in range(_N)])
    v = StepBench.verifying(cfg, params, max_batch=_N, max_seq_len=length, k=_K, batch_invariant=invariant)
    v.context("c8", [tokens(ctx) for _ in range(_N)])
    rows = [tokens(_K) for _ in range(_N)]
    return {
        "decode n=1": lambda: b.decode("c1", [1])[0],
        "decode n=8": lambda: b.decode("c8", list(range(_N)))[0],
        "verify n=8 K=4": lambda: v.verify("c8", rows)[0],
        "prefill": lambda: b.prefill(prompt)[0],
    }


#: A round times a step for at least this long (more calls than `calls` for a step of a fraction of a millisecond,
#: whose median over a few calls on a loaded machine is noise).
ROUND_S = 0.05


def worker(model: str, prefill_len: int, ctx: int, invariant: bool, seed: int, calls: int) -> None:
    """One mode's process: build and compile every step, print `{"ready": true}`, then for each line "round" of
    stdin print {step: median seconds of its calls} (one JSON line each) until stdin closes. A step's calls: the
    prefill once, the others `calls` or as many as fill `ROUND_S` (from a timed call after the compile)."""
    steps = _steps(model, prefill_len, ctx, invariant, seed)
    counts = {}
    for k, f in steps.items():
        f()  # compiles
        counts[k] = 1 if k == "prefill" else max(calls, min(200, int(ROUND_S / max(f(), 1e-6))))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() == "round":
            # NOTE: the prefill once a round: it is the long step (seconds at 45 M), and the rounds give its median.
            print(
                json.dumps({k: statistics.median(f() for _ in range(counts[k])) for k, f in steps.items()}), flush=True
            )


class _Worker:
    """One mode's worker process (`worker`), its stderr kept in a temporary file (nobody reads a pipe of it)."""

    def __init__(self, model: str, prefill_len: int, ctx: int, invariant: bool, seed: int, calls: int):
        env = dict(os.environ)
        if invariant:
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {FMA_PIN_FLAG}".strip()
        args = [model, str(prefill_len), str(ctx), str(int(invariant)), str(seed), str(calls)]
        self.err = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.batch_invariant_steps", "--worker", *args],
            env=env,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
        )

    def ask(self, line: str | None) -> dict:
        """Send `line` (None: nothing) and return the worker's next JSON line."""
        stdin: IO[str] = self.proc.stdin  # type: ignore[assignment]  # opened with stdin=PIPE
        stdout: IO[str] = self.proc.stdout  # type: ignore[assignment]  # opened with stdout=PIPE
        if line is not None:
            stdin.write(line + "\n")
            stdin.flush()
        reply = stdout.readline()
        if not reply:
            self.err.seek(0)
            raise RuntimeError(f"an invariant-bench worker exited ({self.proc.wait()}): {self.err.read()[-3000:]}")
        return json.loads(reply)

    def close(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]  # opened with stdin=PIPE
        self.proc.wait()
        self.err.close()


def compare(model: str, prefill_len: int, ctx: int, rounds: int, calls: int, seed: int) -> list[dict]:
    """One model's rows: {model, step, default_s, invariant_s, ratio, round_ratios} per step of `STEPS`."""
    procs = {inv: _Worker(model, prefill_len, ctx, inv, seed, calls) for inv in (False, True)}
    try:
        for p in procs.values():
            p.ask(None)  # ready: both compiled
        times: dict[bool, list[dict]] = {False: [], True: []}
        for r in range(rounds):
            for inv in (False, True) if r % 2 == 0 else (True, False):
                times[inv].append(procs[inv].ask("round"))
    finally:
        for p in procs.values():
            p.close()
    rows = []
    for step in STEPS:
        base_s = [t[step] for t in times[False]]
        inv_s = [t[step] for t in times[True]]
        ratios = [i / b for b, i in zip(base_s, inv_s)]
        label = f"prefill {prefill_len}" if step == "prefill" else step
        rows.append(
            {
                "model": model,
                "step": label,
                "default_s": statistics.median(base_s),
                "invariant_s": statistics.median(inv_s),
                "ratio": statistics.median(ratios),
                "round_ratios": ratios,
            }
        )
    return rows


def run(s: Settings) -> dict:
    """The section at `s`: every model of `s.invariant_models`."""
    rows = [
        row
        for m in s.invariant_models
        for row in compare(m, s.invariant_prefill, s.ctx, s.invariant_rounds, s.invariant_calls, s.seed)
    ]
    return {
        "models": s.invariant_models,
        "prefill_len": s.invariant_prefill,
        "context_tokens": s.ctx,
        "rounds": s.invariant_rounds,
        "calls": s.invariant_calls,
        "rows": rows,
    }


def main(argv: list[str]) -> None:
    """`--worker MODEL PREFILL_LEN CTX INVARIANT SEED CALLS`: a worker process (`worker`)."""
    if argv[:1] != ["--worker"] or len(argv) != 7:
        raise SystemExit("usage: python -m benchmarks.batch_invariant_steps --worker MODEL PREFILL CTX INV SEED CALLS")
    model, prefill_len, ctx, inv, seed, calls = argv[1:]
    worker(model, int(prefill_len), int(ctx), inv == "1", int(seed), int(calls))


if __name__ == "__main__":
    main(sys.argv[1:])
