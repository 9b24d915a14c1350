"""The parameter pytree: its structure (one place), a seeded random initialiser, and shape specs.

Owns: `param_specs(config)` — the nested dict of `ParamSpec(shape, kind)` every other piece
(initialiser, checkpoint loader and writer, memory planner) walks — and `init_params`.

Structure (weights in HF [out, in] orientation; GDN always in the split Qwen3.5 form):
  embed [V, Hd], final_norm [Hd], lm_head [V, Hd] (absent when tied),
  layers[i]: input_norm, post_norm [Hd];
    gdn: w_in [C + nv*dv + 2nv, Hd] (rows: qkv, z, b, a), conv [C, Kc], dt_bias [nv],
         A_log [nv], norm [dv], out [Hd, nv*dv]
    attn: w_in [H*2D + 2*KV*D, Hd] (rows: q with its gate — per head D query rows then D gate
          rows —, k, v), wo [Hd, H*D], q_norm, k_norm [D]
    mlp: dense {gate_up [2I, Hd] (gate rows, then up), down [Hd, I]} or
         moe {router [E + 1, Hd] (rows: the router, then the shared-expert gate),
              gate_up [E, 2I, Hd], down [E, Hd, I] (the experts),
              shared_gate_up [2Is, Hd] (gate rows, then up), shared_down [Hd, Is] (the shared expert)}
  mtp (when num_mtp_layers > 0): fc [Hd, 2Hd], norm_embedding, norm_hidden, norm [Hd],
       layers[j]: a full-attention layer as above (MLP kind of layer 0).
The `w_in` / `gate_up` / `router` leaves are the checkpoint's projections that read the same input,
stacked by rows (`*_rows` give the parts): one product per layer input instead of one per projection
(the MoE's two: its router rows stay whole on every device, its shared expert splits over heads).
Invariant: `init_params(c, s, d)` and `jax.eval_shape` of it have exactly the shapes of
`param_specs(c)`; zero-centred norm weights are stored zero-centred (applied as 1 + w).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.config import FULL, ModelConfig


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    # linear | embed | norm0 (zero-centred) | norm1 (gated, applied as w) | conv | a_log | dt_bias
    kind: str


def gdn_in_rows(cfg: ModelConfig) -> tuple[int, ...]:
    """Rows of the GDN `w_in` parts: qkv (conv channels), z, b, a."""
    nv = cfg.linear_num_value_heads
    return (cfg.conv_dim, cfg.value_dim, nv, nv)


def attn_in_rows(cfg: ModelConfig) -> tuple[int, ...]:
    """Rows of the attention `w_in` parts: q with its gate, k, v."""
    kv = cfg.num_key_value_heads * cfg.head_dim
    return (cfg.num_attention_heads * 2 * cfg.head_dim, kv, kv)


def moe_router_rows(cfg: ModelConfig) -> tuple[int, ...]:
    """Rows of the MoE `router` parts: the router (one per expert), the shared-expert gate (one)."""
    return (cfg.num_experts, 1)


def shared_in_rows(cfg: ModelConfig) -> tuple[int, ...]:
    """Rows of the MoE `shared_gate_up` parts: the shared expert's gate, up."""
    si = cfg.shared_expert_intermediate_size
    return (si, si)


def dense_in_rows(cfg: ModelConfig) -> tuple[int, ...]:
    """Rows of the dense MLP's `gate_up` parts: gate, up."""
    return (cfg.intermediate_size, cfg.intermediate_size)


def _mlp(cfg: ModelConfig, moe: bool):
    hd = cfg.hidden_size
    if not moe:
        return {
            "gate_up": ParamSpec((sum(dense_in_rows(cfg)), hd), "linear"),
            "down": ParamSpec((hd, cfg.intermediate_size), "linear"),
        }
    e, i = cfg.num_experts, cfg.moe_intermediate_size
    return {
        "router": ParamSpec((sum(moe_router_rows(cfg)), hd), "linear"),
        "gate_up": ParamSpec((e, 2 * i, hd), "linear"),
        "down": ParamSpec((e, hd, i), "linear"),
        "shared_gate_up": ParamSpec((sum(shared_in_rows(cfg)), hd), "linear"),
        "shared_down": ParamSpec((hd, cfg.shared_expert_intermediate_size), "linear"),
    }


def _attn(cfg: ModelConfig):
    hd, h, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    return {
        "w_in": ParamSpec((sum(attn_in_rows(cfg)), hd), "linear"),
        "wo": ParamSpec((hd, h * d), "linear"),
        "q_norm": ParamSpec((d,), "norm0"),
        "k_norm": ParamSpec((d,), "norm0"),
    }


def _gdn(cfg: ModelConfig):
    hd, nv = cfg.hidden_size, cfg.linear_num_value_heads
    return {
        "w_in": ParamSpec((sum(gdn_in_rows(cfg)), hd), "linear"),
        "conv": ParamSpec((cfg.conv_dim, cfg.linear_conv_kernel_dim), "conv"),
        "dt_bias": ParamSpec((nv,), "dt_bias"),
        "A_log": ParamSpec((nv,), "a_log"),
        "norm": ParamSpec((cfg.linear_value_head_dim,), "norm1"),
        "out": ParamSpec((hd, cfg.value_dim), "linear"),
    }


def _layer(cfg: ModelConfig, kind: str, moe: bool):
    hd = cfg.hidden_size
    mixer = {"attn": _attn(cfg)} if kind == FULL else {"gdn": _gdn(cfg)}
    return {
        "input_norm": ParamSpec((hd,), "norm0"),
        "post_norm": ParamSpec((hd,), "norm0"),
        **mixer,
        "mlp": _mlp(cfg, moe),
    }


def param_specs(cfg: ModelConfig) -> dict:
    """The parameter tree of `cfg`, with a `ParamSpec` at every leaf."""
    hd, v = cfg.hidden_size, cfg.vocab_size
    tree = {
        "embed": ParamSpec((v, hd), "embed"),
        "final_norm": ParamSpec((hd,), "norm0"),
        "layers": [_layer(cfg, t, cfg.is_moe_layer(i)) for i, t in enumerate(cfg.layer_types)],
    }
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = ParamSpec((v, hd), "linear")
    if cfg.num_mtp_layers:
        tree["mtp"] = {
            "fc": ParamSpec((hd, 2 * hd), "linear"),
            "norm_embedding": ParamSpec((hd,), "norm0"),
            "norm_hidden": ParamSpec((hd,), "norm0"),
            "norm": ParamSpec((hd,), "norm0"),
            "layers": [_layer(cfg, FULL, cfg.mtp_is_moe) for _ in range(cfg.num_mtp_layers)],
        }
    return tree


def is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def _init_leaf(spec: ParamSpec, key, dtype):
    shape = spec.shape
    if spec.kind in ("linear", "conv"):
        fan_in = shape[-1]
        w = jax.random.normal(key, shape, jnp.float32) * fan_in**-0.5
    elif spec.kind == "embed":
        w = jax.random.normal(key, shape, jnp.float32)
    elif spec.kind == "norm0":
        w = 0.1 * jax.random.normal(key, shape, jnp.float32)
    elif spec.kind == "norm1":
        w = 1.0 + 0.1 * jax.random.normal(key, shape, jnp.float32)
    elif spec.kind == "a_log":
        w = jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0))
    elif spec.kind == "dt_bias":
        w = jax.random.uniform(key, shape, jnp.float32, -1.0, 1.0)
    else:
        raise ValueError(f"unknown parameter kind {spec.kind}")
    return w.astype(dtype)


def init_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32) -> dict:
    """Seeded random parameters with the structure of `param_specs(cfg)`.

    Linear weights are N(0, 1/fan_in) (not HF's 0.02: on a small model that gives near-uniform
    logits and near-tie argmaxes, which make greedy tests meaningless); every norm weight is
    randomised so a missing `1 + w` cannot go unnoticed. Deterministic in (cfg, seed, dtype).
    """
    specs = param_specs(cfg)
    leaves, treedef = jax.tree_util.tree_flatten(specs, is_leaf=is_spec)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree_util.tree_unflatten(treedef, [_init_leaf(s, k, dtype) for s, k in zip(leaves, keys)])


def count_params(tree) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))
