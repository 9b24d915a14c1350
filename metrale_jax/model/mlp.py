"""Feed-forward blocks: the dense SwiGLU MLP and the sparse MoE block with a gated shared expert.

Invariants: the router softmax is float32, top-k weights are renormalised when the config says so
(always for Qwen3.5-MoE) and cast back to the activation dtype; the block output is
routed + sigmoid(shared gate) * shared, with no routed scaling factor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.reductions import ordered_sum, pairwise_sum
from metrale_jax.config import ModelConfig
from metrale_jax.model.linear import linear, linear_parts
from metrale_jax.params import dense_in_rows, moe_in_rows


def swiglu(gate, up, down):
    """down(silu(gate) * up): gate, up [..., I] (the input's projections), down [Hd, I]."""
    return linear(jax.nn.silu(gate) * up, down)


def dense_mlp(p, x, cfg: ModelConfig):
    """The dense SwiGLU MLP; p = {gate_up [2I, Hd] (gate rows, then up), down [Hd, I]}."""
    gate, up = linear_parts(x, p["gate_up"], dense_in_rows(cfg))
    return swiglu(gate, up, p["down"])


# The most activation elements (rows x experts x (2I + Hd)) for which `moe` runs every expert in
# one batched contraction instead of a scan over experts: decode/verify steps of small models.
DENSE_EXPERTS_MAX_ELEMENTS = 1 << 20


def moe(p, x, cfg: ModelConfig):
    """Sparse MoE block. x: [..., Hd]. p: w_in [E + 2Is + 1, Hd] (router, shared-expert gate and
    up, shared-expert gate scalar), gate_up [E, 2I, Hd] (gate rows first), down [E, Hd, I],
    shared_down [Hd, Is].

    Every expert runs on every row, weighted by the row's routing weight (0 when not selected),
    in one of two forms chosen by shape (so one program always takes the same one):
    - small (`DENSE_EXPERTS_MAX_ELEMENTS`): all experts in two batched contractions, the routing
      weights folded into the down projection (one sum over experts x intermediate);
    - otherwise a scan over experts, accumulating in expert-index order in the activation dtype
      as transformers' eager loop does, holding one expert's activations at a time, so the
      compiled program's memory is what a real MoE step needs.
    NOTE: the batched form exists because a scan of E tiny matmuls is E loop iterations of
    launch overhead, which dominates a small step on XLA CPU. It costs
    E/top_k more FLOPs than a grouped matmul, as the scan does.
    """
    logits, shared_gate, shared_up, shared_scale = linear_parts(x, p["w_in"], moe_in_rows(cfg))
    logits32 = logits.astype(jnp.float32)
    e = jnp.exp(logits32 - jnp.max(logits32, axis=-1, keepdims=True))
    probs = e / pairwise_sum(e)[..., None]  # softmax, with a shape-invariant sum
    top_w, top_i = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        top_w = top_w / pairwise_sum(top_w)[..., None]
    top_w = top_w.astype(x.dtype)
    combine = ordered_sum(jax.nn.one_hot(top_i, cfg.num_experts, dtype=x.dtype) * top_w[..., None], axis=-2)  # [..., E]
    inter = cfg.moe_intermediate_size
    rows = x.size // x.shape[-1]
    if rows * cfg.num_experts * (2 * inter + x.shape[-1]) <= DENSE_EXPERTS_MAX_ELEMENTS:
        # NOTE: as one [E*2I, Hd] projection: the einsum over [E, 2I, Hd] made XLA CPU copy the
        # weight into another layout at every step.
        gu = linear(x, p["gate_up"].reshape(-1, x.shape[-1])).reshape(
            *x.shape[:-1], cfg.num_experts, 2 * inter
        )  # [..., E, 2I]
        act = jax.nn.silu(gu[..., :inter]) * gu[..., inter:] * combine[..., None]  # [..., E, I]
        routed = jnp.einsum("...ei,ehi->...h", act, p["down"])  # [..., Hd]
    else:

        def expert(acc, xs):
            gate_up, down, w = xs  # [2I, Hd], [Hd, I], [...]
            gu = linear(x, gate_up)
            out = linear(jax.nn.silu(gu[..., :inter]) * gu[..., inter:], down)
            return acc + out * w[..., None], None

        routed, _ = jax.lax.scan(expert, jnp.zeros_like(x), (p["gate_up"], p["down"], jnp.moveaxis(combine, -1, 0)))
    shared = swiglu(shared_gate, shared_up, p["shared_down"]) * jax.nn.sigmoid(shared_scale)
    return routed + shared


def ffn(p, x, cfg: ModelConfig):
    """The layer's feed-forward: MoE when its params carry a shared expert, else the dense MLP."""
    return moe(p, x, cfg) if "shared_down" in p else dense_mlp(p, x, cfg)
