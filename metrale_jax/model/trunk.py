"""The hybrid trunk, the LM head and the MTP head as pure functions over a state IO.

Owns: the layer loop (pre-norm, two residual adds), the layer-kind dispatch (GDN or gated
attention; MoE or dense FFN), the final norm + lm_head, and the MTP module's forward.

Invariants:
- `trunk` returns the pre-final-norm hidden (what the engine stashes) and the new state; `head`
  applies the final norm and the lm_head and returns float32 logits.
- The MTP head sees `embed(token)` and the trunk hidden after the final norm (config switch
  `mtp_hidden_postnorm`); it shares the trunk's embedding and lm_head.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from metrale_jax.config import FULL, LINEAR, ModelConfig
from metrale_jax.model import attention as attn_math
from metrale_jax.model import gdn as gdn_math
from metrale_jax.model.linear import linear
from metrale_jax.model.mlp import ffn
from metrale_jax.model.norms import rms_norm


def decoder_layer(lp, x, positions, cfg: ModelConfig, kind: str, idx: int, io, state):
    """One pre-norm block. idx indexes the layer's kind in the state (linear or full layer number)."""
    h = rms_norm(x, lp["input_norm"], cfg.rms_norm_eps)
    if kind == FULL:
        q, k, v, gate = attn_math.project(lp["attn"], h, positions, cfg)
        o, state = io.attention(state, idx, q, k, v)
        x = x + attn_math.output(lp["attn"], o, gate)
    else:
        mixed, z, b, a = gdn_math.project(lp["gdn"], h, cfg)
        o, state = io.gdn(state, idx, lp["gdn"], mixed, b, a)
        x = x + gdn_math.output(lp["gdn"], o, z, cfg, x.dtype)
    x = x + ffn(lp["mlp"], rms_norm(x, lp["post_norm"], cfg.rms_norm_eps), cfg)
    return x, state


def trunk(params, cfg: ModelConfig, tokens, io, state):
    """tokens [B, T] int32 -> (hidden [B, T, Hd] before the final norm, new state).

    params may be in list layout (`layers`) or scan layout (`layer_groups`, see
    `metrale_jax.model.layer_groups`): the scan loops over groups with the state in the carry, and each
    layer addresses its state by (group * layers of its kind per group + its rank in the group).
    """
    chex.assert_rank(tokens, 2)
    chex.assert_type(tokens, jnp.int32)
    chex.assert_shape(io.positions, tokens.shape)
    x = params["embed"][tokens]
    if "layer_groups" not in params:
        counters = {LINEAR: 0, FULL: 0}
        for lp, kind in zip(params["layers"], cfg.layer_types):
            x, state = decoder_layer(lp, x, io.positions, cfg, kind, counters[kind], io, state)
            counters[kind] += 1
        return x, state
    pattern = cfg.layer_types[: len(params["layer_groups"])]
    per_group = {k: pattern.count(k) for k in (LINEAR, FULL)}
    rank = [pattern[:j].count(kind) for j, kind in enumerate(pattern)]

    def group(carry, gp):
        x, state, g = carry
        for j, (lp, kind) in enumerate(zip(gp, pattern)):
            x, state = decoder_layer(lp, x, io.positions, cfg, kind, g * per_group[kind] + rank[j], io, state)
        return (x, state, g + 1), None

    (x, state, _), _ = jax.lax.scan(group, (x, state, jnp.int32(0)), params["layer_groups"])
    chex.assert_shape(x, (*tokens.shape, cfg.hidden_size))
    return x, state


def lm_head(params, cfg: ModelConfig, normed):
    w = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    # NOTE: the barrier orders the weight after the rows: XLA CPU converts a bf16 weight to f32 for the
    # product and scheduled that copy (1.19 GB for the 80B's lm_head) at the program's start, where it
    # stayed live through every layer of a prefill. A no-op on values and on a GPU.
    normed, w = jax.lax.optimization_barrier((normed, w))
    logits = linear(normed, w).astype(jnp.float32)
    return stress_edges(logits) if cfg.vocab_stress else logits


def stress_edges(logits):
    """`cfg.vocab_stress` (`diff --vocab-stress`): logits [..., V] f32 with, in each row whose
    first argmax a has a % 3 == 1 (== 2), the values at a and at id 0 (at id V - 1) swapped.
    A permutation of each row, a function of that row alone: the argmax moves onto the edge id
    (ties aside), the row's values (and its log-softmax's) stay the same set."""
    v = logits.shape[-1]
    top = jnp.argmax(logits, axis=-1)[..., None]
    edge = jnp.where(top % 3 == 1, 0, jnp.where(top % 3 == 2, v - 1, top))
    ids = jnp.arange(v)
    src = jnp.where(ids == edge, top, jnp.where(ids == top, edge, ids))
    return jnp.take_along_axis(logits, src, axis=-1)


def final_norm(params, cfg: ModelConfig, hidden):
    return rms_norm(hidden, params["final_norm"], cfg.rms_norm_eps)


def head(params, cfg: ModelConfig, hidden):
    """Pre-norm hidden [..., Hd] -> float32 logits [..., V]."""
    return lm_head(params, cfg, final_norm(params, cfg, hidden))


def mtp_forward(params, cfg: ModelConfig, tokens, hidden_in, io, state, layer: int = 0):
    """One MTP step over rows: tokens [B, T] (the next tokens), hidden_in [B, T, Hd] (the trunk's
    normed hidden, or the previous MTP step's normed output when chaining).

    Returns (m [B, T, Hd] after mtp.norm — the next chained hidden —, logits f32, new state).
    The MTP layer is a full-attention layer whose KV is layer `layer` of the IO's state.
    """
    chex.assert_rank(tokens, 2)
    chex.assert_shape(hidden_in, (*tokens.shape, cfg.hidden_size))
    mp = params["mtp"]
    e = params["embed"][tokens]
    u = jnp.concatenate(
        [rms_norm(e, mp["norm_embedding"], cfg.rms_norm_eps), rms_norm(hidden_in, mp["norm_hidden"], cfg.rms_norm_eps)],
        axis=-1,
    )
    u = linear(u, mp["fc"])
    u, state = decoder_layer(mp["layers"][layer], u, io.positions, cfg, FULL, layer, io, state)
    m = rms_norm(u, mp["norm"], cfg.rms_norm_eps)
    return m, lm_head(params, cfg, m), state
