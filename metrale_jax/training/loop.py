"""The training loop and the held-out evaluation.

Owns: the optimiser (AdamW, warm-up + cosine, clipping; no decay on vectors), the jitted step,
`evaluate` (sums over whole windows, reported per token) and `train`, which returns the params
and a JSON-ready log: the training-loss curve, the validation curve and the final validation.

Invariant: a run is a pure function of (config, recipe, corpus): one seed draws the init and
every batch, and nothing reads the clock except the log's `elapsed_s`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from metrale_jax.config import ModelConfig
from metrale_jax.training.corpus import Corpus, random_windows, tiling_windows
from metrale_jax.training.objective import init_for_training, objective, window_metrics
from metrale_jax.training.recipe import TrainRecipe


def lr_schedule(r: TrainRecipe) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(0.0, r.lr, r.warmup, r.steps, end_value=r.lr * r.final_lr_frac)


def optimizer(r: TrainRecipe) -> optax.GradientTransformation:
    decay_mask = lambda params: jax.tree_util.tree_map(lambda w: w.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(r.clip_norm),
        optax.adamw(lr_schedule(r), b1=0.9, b2=0.95, weight_decay=r.weight_decay, mask=decay_mask),
    )


_window_metrics = jax.jit(window_metrics, static_argnames=("cfg",))


def evaluate(params, cfg: ModelConfig, windows: np.ndarray, batch: int) -> dict:
    """Per-token means over windows [N, T + 2]: loss (nats), ppl, bits_per_byte, mtp_loss,
    top-1 accuracies and teacher-forced first-draft acceptance (see `window_metrics`)."""
    n, t = windows.shape[0], windows.shape[1] - 2
    sums: dict[str, float] = {}
    for off in range(0, n, batch):
        part = windows[off : off + batch]
        real = part.shape[0]
        if real < batch:  # pad with copies; only the first `real` rows are summed
            part = np.concatenate([part, np.repeat(part[:1], batch - real, 0)])
        m = _window_metrics(params, cfg, jnp.asarray(part))
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + float(np.asarray(v)[:real].sum())
    tokens = n * t
    loss = sums["loss"] / tokens
    return {
        "tokens": tokens,
        "loss": loss,
        "ppl": math.exp(loss),
        "bits_per_byte": loss / math.log(2),
        "mtp_loss": sums["mtp_loss"] / tokens,
        "top1": sums["hits"] / tokens,
        "mtp_top1": sums["mtp_hits"] / tokens,
        "first_draft_agreement": sums["agree"] / (n * (t - 1)),
    }


def train(cfg: ModelConfig, r: TrainRecipe, corpus: Corpus, log: Callable[[str], None] = print):
    """Train from `init_for_training(cfg, r.seed)`; returns (params, log dict)."""
    rng = np.random.default_rng(r.seed)
    params = init_for_training(cfg, r.seed)
    opt = optimizer(r)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, windows):
        (_, m), g = jax.value_and_grad(objective, has_aux=True)(params, cfg, windows, r.mtp_weight)
        updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, m

    curve_windows = tiling_windows(corpus.val, r.seq_len, r.eval_windows)
    lr_at = lr_schedule(r)
    history: dict[str, list] = {"train": [], "val": []}
    acc = {"loss": 0.0, "mtp_loss": 0.0}
    seen = 0
    t0 = time.time()
    for i in range(1, r.steps + 1):
        windows = random_windows(corpus.train, rng, r.batch, r.seq_len + 2)
        params, opt_state, m = step(params, opt_state, jnp.asarray(windows))
        acc = {k: acc[k] + float(m[k]) for k in acc}
        seen += 1
        if i % r.log_every == 0 or i == r.steps:
            row = {
                "step": i,
                **{k: v / seen for k, v in acc.items()},
                "lr": float(lr_at(i)),
                "elapsed_s": round(time.time() - t0, 1),
            }
            history["train"].append(row)
            log(
                f"step {i:5d}  loss {row['loss']:.4f}  mtp {row['mtp_loss']:.4f}  "
                f"lr {row['lr']:.2e}  {row['elapsed_s']:.0f}s"
            )
            acc, seen = {k: 0.0 for k in acc}, 0
        if i % r.eval_every == 0 or i == r.steps:
            ev = evaluate(params, cfg, curve_windows, r.batch)
            history["val"].append({"step": i, **ev})
            log(
                f"step {i:5d}  val loss {ev['loss']:.4f}  ppl {ev['ppl']:.3f}  "
                f"mtp {ev['mtp_loss']:.4f}  agree {ev['first_draft_agreement']:.3f}"
            )
    train_s = time.time() - t0
    final = evaluate(params, cfg, tiling_windows(corpus.val, r.seq_len), r.batch)
    log(
        f"final val: loss {final['loss']:.4f}  ppl {final['ppl']:.3f}  "
        f"bits/byte {final['bits_per_byte']:.3f}  first-draft agreement {final['first_draft_agreement']:.3f}"
    )
    return params, {
        "recipe": dataclasses.asdict(r),
        "corpus": corpus.summary(),
        "train_seconds": round(train_s, 1),
        "curve": history,
        "final_val": final,
    }
