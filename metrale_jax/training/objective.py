"""The training objective: next-token loss of the trunk plus next-next-token loss of the MTP
head, over the engine's own model functions.

Owns: `TrainOps` (the forward's ops with a training-friendly GDN chunk), `init_for_training`
and `window_metrics` (per-window sums of losses and top-1 hits, the one function both the loss
and the evaluation read).

Invariants:
- The trunk runs `metrale_jax.model.cache.forward` (chunked GDN, differentiable); the MTP head
  runs `mtp_forward` over the pairs (trunk hidden at t, token t+1) at position t, predicting
  token t+2 — exactly the rows the engine's drafter catch-up writes, so training and drafting
  see the same inputs (including the `mtp_hidden_postnorm` switch).
- `TrainOps` computes the same math as the engine's reference ops in a differentiable,
  CPU-friendly form: a 16-row GDN chunk (the same recurrence, cheaper to differentiate than 64
  rows) and attention over the whole gathered cache with a causal mask (the reference walks
  key tiles in a dynamic loop, which reverse-mode differentiation cannot go through).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from kernels_pallas.gdn import reference as gdn_ref
from kernels_pallas.ops import ReferenceOps
from metrale_jax.config import ModelConfig
from metrale_jax.model.cache import forward, new_cache
from metrale_jax.model.state_io import PoolIO
from metrale_jax.model.trunk import final_norm, mtp_forward
from metrale_jax.params import init_params, is_spec, param_specs


@dataclasses.dataclass(frozen=True)
class TrainOps(ReferenceOps):
    """The reference ops, differentiable: a shorter GDN chunk and dense masked attention."""

    name: str = "xla-train"
    chunk: int = 16

    def gdn_chunk(self, q, k, v, g, beta, h0):
        return gdn_ref.chunk_gated_delta_rule(q, k, v, g, beta, h0, chunk_size=self.chunk)

    def attention(self, q, k_cache, v_cache, block_tables, positions, scale, layer=None):
        """Causal GQA attention of rows q [B, T, H, D] (positions [B, T], < 0 = padding) over
        their sequences' paged KV (stacked caches read at `layer`), all keys at once; f32 scores
        and softmax."""
        if layer is not None:
            k_cache, v_cache = k_cache[layer], v_cache[layer]
        b, t, h, d = q.shape
        _, bs, kvh, _ = k_cache.shape
        span = block_tables.shape[1] * bs
        keys = k_cache[block_tables].reshape(b, span, kvh, d).astype(q.dtype)
        vals = v_cache[block_tables].reshape(b, span, kvh, d).astype(q.dtype)
        qg = q.reshape(b, t, kvh, h // kvh, d)
        scores = jnp.einsum("btgrd,bsgd->btgrs", qg, keys, preferred_element_type=jnp.float32) * scale
        mask = jnp.arange(span)[None, None, :] <= positions[:, :, None]  # [B, T, S]
        probs = jax.nn.softmax(jnp.where(mask[:, :, None, None, :], scores, -jnp.inf), axis=-1)
        probs = jnp.where((positions >= 0)[:, :, None, None, None], probs, 0.0)
        out = jnp.einsum("btgrs,bsgd->btgrd", probs.astype(q.dtype), vals)
        return out.reshape(b, t, h, d)


def init_for_training(cfg: ModelConfig, seed: int) -> dict:
    """`init_params` with the norms reset to identity (zero-centred weights 0, gated-norm
    weights 1): `init_params` randomises them on purpose for tests, which training does not want."""
    params = init_params(cfg, seed)
    reset = {"norm0": jnp.zeros_like, "norm1": jnp.ones_like}
    return jax.tree_util.tree_map(
        lambda spec, w: reset[spec.kind](w) if spec.kind in reset else w,
        param_specs(cfg),
        params,
        is_leaf=is_spec,
    )


def window_metrics(params, cfg: ModelConfig, windows, ops=TrainOps()) -> dict:
    """Per-window sums over windows [B, T + 2] int32 (the trunk reads the first T tokens).

    Returns float32 [B] arrays: `loss` (trunk cross-entropy over its T next-token targets),
    `mtp_loss` (MTP cross-entropy over its T next-next-token targets), `hits` / `mtp_hits` (top-1
    correct), and `agree` — over positions 0..T-2, whether the MTP head's argmax equals the
    trunk's argmax one position later: teacher-forced first-draft acceptance.
    """
    b, t = windows.shape[0], windows.shape[1] - 2
    inp = windows[:, :t]
    logits, hidden, _ = forward(params, cfg, inp, new_cache(cfg, b, t), jnp.int32(0), ops)
    mtp_in = final_norm(params, cfg, hidden) if cfg.mtp_hidden_postnorm else hidden
    cache = new_cache(cfg, b, t)
    io = PoolIO(
        cfg=cfg,
        slots=None,
        lens=None,
        positions=jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
        block_tables=jnp.arange(b, dtype=jnp.int32)[:, None],
        null_block=b,
        gdn_mode="rows",
        ops=ops,
    )
    state = cache.replace(kv_k=cache.kv_k[: cfg.num_mtp_layers], kv_v=cache.kv_v[: cfg.num_mtp_layers])
    _, mtp_logits, _ = mtp_forward(params, cfg, windows[:, 1 : t + 1], mtp_in, io, state)
    ce = optax.softmax_cross_entropy_with_integer_labels
    main_arg, mtp_arg = jnp.argmax(logits, -1), jnp.argmax(mtp_logits, -1)
    return {
        "loss": ce(logits, windows[:, 1 : t + 1]).sum(-1),
        "mtp_loss": ce(mtp_logits, windows[:, 2:]).sum(-1),
        "hits": (main_arg == windows[:, 1 : t + 1]).sum(-1).astype(jnp.float32),
        "mtp_hits": (mtp_arg == windows[:, 2:]).sum(-1).astype(jnp.float32),
        "agree": (mtp_arg[:, :-1] == main_arg[:, 1:]).sum(-1).astype(jnp.float32),
    }


def objective(params, cfg: ModelConfig, windows, mtp_weight: float, ops=TrainOps()):
    """Mean next-token loss + mtp_weight * mean next-next-token loss; returns (loss, metrics)."""
    m = window_metrics(params, cfg, windows, ops)
    n = windows.shape[0] * (windows.shape[1] - 2)
    main, mtp = m["loss"].sum() / n, m["mtp_loss"].sum() / n
    return main + mtp_weight * mtp, {"loss": main, "mtp_loss": mtp}
