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

    NOTE: a scan over experts runs each expert on every row and weights it by the row's routing
    weight (0 when not selected), accumulating in expert-index order in the activation dtype, as
    transformers' eager loop does (bitwise the same sums in bfloat16). It costs E/top_k more
    FLOPs than a grouped matmul but holds one expert's activations at a time, so the compiled
    program's memory is what a real MoE step needs.
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

    def expert(acc, xs):
        gate_up, down, w = xs  # [2I, Hd], [Hd, I], [...]
        gu = _lin(x, gate_up)
        out = _lin(jax.nn.silu(gu[..., :inter]) * gu[..., inter:], down)
        return acc + out * w[..., None], None

    routed, _ = jax.lax.scan(expert, jnp.zeros_like(x), (p["gate_up"], p["down"], jnp.moveaxis(combine, -1, 0)))
    shared = swiglu(p["shared"], x) * jax.nn.sigmoid(_lin(x, p["shared_gate"]))
    return routed + shared


def ffn(p, x, cfg: ModelConfig):
    """The layer's feed-forward: MoE when its params carry a router, else the dense MLP."""
    return moe(p, x, cfg) if "router" in p else swiglu(p, x)
