"""Probe `step-times`: device times of a model's decode and verify programs in the source tree this
interpreter imports (its path is printed next to the times), for side-by-side comparisons of two trees: run
each tree's own command in its own checkout, alternating the processes:

    .venv/bin/python -m benchmarks step-times [LABEL] [MODEL]

MODEL: a `benchmarks.models.model` name (default tiny). Each program alone on its captured arguments
(`benchmarks.steps.DeviceStep`), median of 300 calls after 20. Owns `captured_step`, which the
`thunk-profile` and `layout-ab` probes time too.
"""

import os

import click
import numpy as np

import metrale_jax
from benchmarks import models
from benchmarks.steps import DeviceStep
from metrale_jax.engine.engine import Engine


def captured_step(cfg, params, kind: str, n: int, k: int, rng) -> DeviceStep:
    """The compiled `kind` program (decode; a verify of K = k rows; `fused`: the fused speculative step, a verify
    of K = k rows then a propose of k - 1 drafts) over n sequences of 128 tokens, captured on its arguments by an
    engine built now. The rows are random tokens, as a generation's are: rows of one token route alike through an
    MoE (the 45 M verify of K = 4 ran 0.87x the time on rows of token 1, its experts read fewer)."""
    flags: dict = dict(max_batch_size=8, max_seq_len=256)
    if kind in ("verify", "fused"):
        flags.update(speculative=True, num_drafts=k - 1, mtp_k_ladder=f"8:{k - 1}")
    e = Engine(cfg, params, models.settings(**flags))
    seqs = [e.alloc_sequence() for _ in range(n)]
    for s in seqs:
        e.prefill(s, rng.integers(0, cfg.vocab_size, 128).tolist())
    rows = rng.integers(0, cfg.vocab_size, n * k).tolist()
    if kind == "decode":
        dev, _ = DeviceStep.capture(e, lambda: e.decode_batch(seqs, rows))
    elif kind == "fused":
        step = lambda: e.speculative_step(seqs, rows, [k] * n, k - 1)
        dev, _ = DeviceStep.capture(e, step, "speculative_step")
    else:
        dev, _ = DeviceStep.capture(e, lambda: e.verify_batched(seqs, rows, [k] * n))
    return dev


def device_ms(cfg, params, kind: str, n: int, k: int, rng) -> float:
    """Median ms of one `captured_step` program."""
    dev = captured_step(cfg, params, kind, n, k, rng)
    dev.time(20)
    return round(dev.time(300) * 1e3, 4)


STEPS = [("decode", 1, 1), ("decode", 8, 1), ("verify", 1, 4), ("verify", 8, 4)]


@click.command("step-times", help="Device times of a model's decode and verify programs (median ms).")
@click.argument("label", default="")
@click.argument("model", default="tiny")
def command(label: str, model: str) -> None:
    cfg, params = models.model(model)
    rng = np.random.default_rng(0)
    out = {f"{kind} n={n} K={k}": device_ms(cfg, params, kind, n, k, rng) for kind, n, k in STEPS}
    print(label, os.path.dirname(os.path.dirname(metrale_jax.__file__)), out)
