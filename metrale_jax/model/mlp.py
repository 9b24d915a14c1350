"""Feed-forward blocks: the dense SwiGLU MLP and the sparse MoE block with a gated shared expert.

Invariants: the router softmax is float32, top-k weights are renormalised when the config says so
(always for Qwen3.5-MoE) and cast back to the activation dtype; the block output is
routed + sigmoid(shared gate) * shared, with no routed scaling factor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from metrale_jax.config import ModelConfig


def _lin(x, w):
    """x [..., in] @ w[out, in].T in the activation dtype."""
    return jnp.einsum("...i,oi->...o", x, w)


def swiglu(p, x):
    """down(silu(gate(x)) * up(x)); p = {gate [I, Hd], up [I, Hd], down [Hd, I]}."""
    return _lin(jax.nn.silu(_lin(x, p["gate"])) * _lin(x, p["up"]), p["down"])


def moe(p, x, cfg: ModelConfig):
    """Sparse MoE block. x: [..., Hd]. p: router [E, Hd], gate_up [E, 2I, Hd] (gate rows first),
    down [E, Hd, I], shared {gate, up, down}, shared_gate [1, Hd].

    NOTE: every expert runs on every row and the non-selected ones get weight 0. That is exact
    (a zero weight contributes nothing) and the simplest correct reference; it costs E/top_k more
    FLOPs, which is fine for the small models this reference forward is checked on.
    """
    logits = _lin(x, p["router"])
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top_w, top_i = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    top_w = top_w.astype(x.dtype)
    combine = jnp.sum(
        jax.nn.one_hot(top_i, cfg.num_experts, dtype=x.dtype) * top_w[..., None], axis=-2
    )  # [..., E]
    inter = cfg.moe_intermediate_size
    gu = jnp.einsum("...i,eoi->...eo", x, p["gate_up"])
    h = jax.nn.silu(gu[..., :inter]) * gu[..., inter:]
    expert_out = jnp.einsum("...ei,eoi->...eo", h, p["down"])  # [..., E, Hd]
    # NOTE: routed outputs are accumulated in expert-index order in the activation dtype, each
    # product and sum rounded, as transformers does (it matters in bfloat16 only).
    terms = jnp.moveaxis(expert_out * combine[..., None], -2, 0)  # [E, ..., Hd]
    routed, _ = jax.lax.scan(lambda acc, t: (acc + t, None), jnp.zeros_like(terms[0]), terms)
    shared = swiglu(p["shared"], x) * jax.nn.sigmoid(_lin(x, p["shared_gate"]))
    return routed + shared


def ffn(p, x, cfg: ModelConfig):
    """The layer's feed-forward: MoE when its params carry a router, else the dense MLP."""
    return moe(p, x, cfg) if "router" in p else swiglu(p, x)
