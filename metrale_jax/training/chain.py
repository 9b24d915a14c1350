"""The drafter's chained fine-tune: the MTP head trained on the inputs its later drafts read.

Owns: `ChainIO` (the attention a chained draft sees, in parallel over every base position),
`chain_logits`, `chain_metrics` (per-depth losses and agreement with the trunk) and `train_chain` (Adam on the
`mtp` parameters alone, the trunk, the embedding and the lm_head frozen).

Why: the engine's propose chains the MTP head — draft j reads the previous draft's token and the
previous MTP step's normed output — while `objective` trains only its first step, on the trunk's
hidden. Later drafts then see inputs it never trained on, and accept far less often.

Invariants:
- Depth d (1-based) at base position i is exactly the engine's draft d-1 after committed token
  i + 1: position i + d - 1, token i + d, hidden the trunk's (d = 1) or depth d-1's output at i.
- Its attention sees what the drafter's KV holds then: depth-1 entries (the catch-up's) at
  positions 0..i, then this chain's own entries of depths 2..d at i + 1..i + d - 1.
- Targets are the trunk's argmaxes one position ahead (self-distillation): a draft is accepted
  when it equals the trunk's argmax, not the text's next byte.
- The trunk runs once per batch under `stop_gradient`; only `params["mtp"]` changes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from metrale_jax.config import ModelConfig
from metrale_jax.model.cache import forward, new_cache
from metrale_jax.model.trunk import final_norm, mtp_forward
from metrale_jax.training.corpus import Corpus, random_windows, tiling_windows
from metrale_jax.training.objective import TrainOps
from metrale_jax.training.recipe import TrainRecipe


@dataclasses.dataclass(frozen=True)
class ChainIO:
    """The state IO `mtp_forward` calls at one chain depth over rows [B, T] (row i = base i).

    `attention` attends query row i over `prior[0]`'s keys 0..i (depth 1) and row i of each later
    prior depth and of this depth; it returns the priors plus this depth's (k, v) as the state."""

    positions: jax.Array  # [B, T] int32: i + depth - 1

    def attention(self, prior: tuple, ai: int, q, k, v):
        b, t, h, d = q.shape
        kvh = k.shape[2]
        qg = q.reshape(b, t, kvh, h // kvh, d)
        scale = d**-0.5
        depth = prior + ((k, v),)
        k1, v1 = depth[0]
        causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]  # [T query, T key]
        s1 = jnp.einsum("btgrd,bsgd->btgrs", qg, k1) * scale
        s1 = jnp.where(causal[None, :, None, None, :], s1, -jnp.inf)
        own = [jnp.einsum("btgrd,btgd->btgr", qg, kd)[..., None] * scale for kd, _ in depth[1:]]
        probs = jax.nn.softmax(jnp.concatenate([s1, *own], axis=-1), axis=-1)
        out = jnp.einsum("btgrs,bsgd->btgrd", probs[..., :t], v1)
        for n, (_, vd) in enumerate(depth[1:]):
            out = out + probs[..., t + n, None] * vd[:, :, :, None, :]
        return out.reshape(b, t, h, d), depth


def chain_logits(mtp, params, cfg: ModelConfig, windows, depth: int):
    """The trunk's logits [B, T + depth, V] over windows [B, T + depth] int32 and, for each depth
    d = 1..depth, the MTP head's logits [B, T, V] at every base 0..T-1 (row i: draft d-1 after
    committed token i + 1, fed tokens windows[:, i + 1 .. i + d]). Gradients reach `mtp` only."""
    b, t = windows.shape[0], windows.shape[1] - depth
    frozen = jax.lax.stop_gradient(params)
    logits, hidden, _ = forward(frozen, cfg, windows, new_cache(cfg, b, t + depth), jnp.int32(0), TrainOps())
    hid = (final_norm(frozen, cfg, hidden) if cfg.mtp_hidden_postnorm else hidden)[:, :t]
    full = {**frozen, "mtp": mtp}
    state: tuple = ()
    chained = []
    for d in range(1, depth + 1):
        io = ChainIO(positions=jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + d - 1, (b, t)))
        hid, out, state = mtp_forward(full, cfg, windows[:, d : t + d], hid, io, state, (d - 1) % cfg.num_mtp_layers)
        chained.append(out)
    return jax.lax.stop_gradient(logits), chained


def chain_metrics(mtp, params, cfg: ModelConfig, windows, depth: int) -> dict:
    """Per-depth sums over windows [B, T + depth] int32 (bases 0..T-1).

    Returns float32 [depth] arrays: `loss` (cross-entropy of depth d's logits against the trunk's
    argmax at position i + d, summed over bases and windows) and `agree` (depth d's argmax equals
    the trunk's there, summed)."""
    t = windows.shape[1] - depth
    logits, chained = chain_logits(mtp, params, cfg, windows, depth)
    top = jnp.argmax(logits, -1)
    ce = optax.softmax_cross_entropy_with_integer_labels
    losses = [ce(out, top[:, d : t + d]).sum() for d, out in enumerate(chained, 1)]
    agree = [(jnp.argmax(out, -1) == top[:, d : t + d]).sum().astype(jnp.float32) for d, out in enumerate(chained, 1)]
    return {"loss": jnp.stack(losses), "agree": jnp.stack(agree)}


_chain_metrics = jax.jit(chain_metrics, static_argnames=("cfg", "depth"))


def evaluate_chain(params, cfg: ModelConfig, windows: np.ndarray, depth: int, batch: int) -> dict:
    """Per-base means over windows [N, T + depth]: loss and agreement by depth (lists)."""
    n, t = windows.shape[0], windows.shape[1] - depth
    loss, agree = np.zeros(depth), np.zeros(depth)
    for off in range(0, n - batch + 1, batch):
        m = _chain_metrics(params["mtp"], params, cfg, jnp.asarray(windows[off : off + batch]), depth)
        loss += np.asarray(m["loss"])
        agree += np.asarray(m["agree"])
    count = (n // batch) * batch * t
    return {"loss": (loss / count).tolist(), "agree": (agree / count).tolist()}


def train_chain(params, cfg: ModelConfig, r: TrainRecipe, corpus: Corpus, log: Callable[[str], None] = print):
    """Fine-tune `params["mtp"]` for `r.chain_steps` steps of `r.batch` windows; returns (params, log
    dict: the chain recipe's curve and the held-out agreement by depth before and after)."""
    rng = np.random.default_rng(r.seed + 1)
    depth, seq = r.chain_depth, r.chain_seq_len
    warmup = min(r.chain_warmup, r.chain_steps // 4)
    sched = optax.warmup_cosine_decay_schedule(0.0, r.chain_lr, warmup, r.chain_steps, r.chain_lr * 0.1)
    opt = optax.chain(optax.clip_by_global_norm(r.clip_norm), optax.adam(sched, b1=0.9, b2=0.95))
    weights = jnp.asarray(r.chain_weights[:depth], jnp.float32)

    def loss_fn(mtp, windows):
        m = chain_metrics(mtp, params, cfg, windows, depth)
        return (weights * m["loss"]).sum() / (windows.shape[0] * seq), m

    @jax.jit
    def step(mtp, opt_state, windows):
        (_, m), g = jax.value_and_grad(loss_fn, has_aux=True)(mtp, windows)
        updates, opt_state = opt.update(g, opt_state, mtp)
        return optax.apply_updates(mtp, updates), opt_state, m

    val = tiling_windows(corpus.val, seq + depth - 2, r.eval_windows)
    before = evaluate_chain(params, cfg, val, depth, r.batch)
    log(f"chain: held-out agreement by depth before {', '.join(f'{a:.3f}' for a in before['agree'])}")
    mtp, opt_state = params["mtp"], opt.init(params["mtp"])
    curve = []
    t0 = time.time()
    for i in range(1, r.chain_steps + 1):
        windows = random_windows(corpus.train, rng, r.batch, seq + depth)
        mtp, opt_state, m = step(mtp, opt_state, jnp.asarray(windows))
        if i % r.log_every == 0 or i == r.chain_steps:
            per = (np.asarray(m["loss"]) / (r.batch * seq)).tolist()
            curve.append({"step": i, "loss": per, "elapsed_s": round(time.time() - t0, 1)})
            log(f"chain step {i:4d}  loss by depth {', '.join(f'{x:.4f}' for x in per)}  {time.time() - t0:.0f}s")
    params = {**params, "mtp": mtp}
    after = evaluate_chain(params, cfg, val, depth, r.batch)
    log(f"chain: held-out agreement by depth after {', '.join(f'{a:.3f}' for a in after['agree'])}")
    return params, {"seconds": round(time.time() - t0, 1), "curve": curve, "before": before, "after": after}
