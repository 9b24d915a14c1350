"""The models and serve settings the benchmarks run, and the checkpoint both sides load.

Owns: `qwen3_next_pattern` (the released Qwen3-Next layer pattern, any depth, at the tiny preset's
width: the graph that decides compile time is the layer count), `qwen35_stack` (a Qwen3.5-35B-A3B
layer stack at full width for the GPU roofline, or at tiny width for its dry run), `SMALL` (the
smoke run's models), `WIDE` (the realistic-width models of `make bench`), `parameter_count`, `settings`
(EngineSettings from flags, as the tests build them) and `write_checkpoint` (the random
checkpoint in the HF safetensors layout, rewritten whenever the weights change, so HF
`from_pretrained` reads the very weights the engine runs).
"""

from __future__ import annotations

import hashlib
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.checkpoint import save_checkpoint
from metrale_jax.config import FULL, LINEAR, ModelConfig, load_model_config
from metrale_jax.engine.settings import resolve_settings
from metrale_jax.params import init_params, is_spec, param_specs
from metrale_jax.presets import PRESETS, TINY, resolve_checkpoint


def interval_pattern(layers: int, interval: int = 4) -> tuple[str, ...]:
    """Qwen3-Next / Qwen3.5 `full_attention_interval`: layer i is full attention iff (i+1) % interval == 0."""
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers))


def qwen3_next_pattern(layers: int = 48, interval: int = 4) -> ModelConfig:
    """The Qwen3-Next-80B-A3B stack (full attention every 4th layer, MoE in every layer, one MTP
    layer) at the tiny preset's widths. 48 layers = 12 groups of 4 in the scan layout."""
    return TINY.replace(num_hidden_layers=layers, layer_types=interval_pattern(layers, interval), mlp_only_layers=())


def qwen35_stack(layers: int = 4, tiny: bool = False) -> ModelConfig:
    """Qwen3.5-35B-A3B (hidden 2048, GDN nk 16 / nv 32 x 128, attention 16:2 x 256, 256 experts
    top-8 of 512, shared 512, vocab 248320, one MTP layer) with `layers` layers of its pattern
    (3 GDN : 1 attention). tiny: the same pattern at the tiny preset's widths (dry runs)."""
    if tiny:
        return TINY.replace(
            model_type="qwen3_5_moe_text",
            num_hidden_layers=layers,
            layer_types=interval_pattern(layers),
            mlp_only_layers=(),
            weight_layout="qwen3_5",
            trunk_prefix="model.language_model",
            # dk = dv, as in the release (gpu_check's kernel cases assume it)
            linear_key_head_dim=TINY.linear_value_head_dim,
        )
    return ModelConfig(
        model_type="qwen3_5_moe_text",
        vocab_size=248320,
        hidden_size=2048,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        layer_types=interval_pattern(layers),
        rope_theta=1e7,
        partial_rotary_factor=0.25,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        num_mtp_layers=1,
        weight_layout="qwen3_5",
        trunk_prefix="model.language_model",
    )


# Small models for the smoke run (compile time grows with the layer count):
# tiny-2L: the tiny preset's first two layers (GDN + MoE, attention + dense MLP); qwen35-moe-2L: the same two
# mixers, both with MoE, in the Qwen3.5-MoE checkpoint layout (the smoke run's stand-in for qwen35-moe-h1024).
SMALL = {
    "tiny-2L": TINY.replace(num_hidden_layers=2, layer_types=(LINEAR, FULL), mlp_only_layers=(1,)),
    "qwen35-moe-2L": qwen35_stack(2, tiny=True).replace(layer_types=(LINEAR, FULL)),
}

# Realistic widths, where a win at hidden 64 has to hold up: per-op overhead no longer hides the arithmetic
# and the weight traffic. Both have one MTP layer, so their verify runs speculative.
# - qwen3-next-h512 (45 M parameters without its MTP layer, 50 M with it): Qwen3-Next layout, hidden 512, 8
#   layers of the 3:1 pattern, GDN 4 key / 8 value heads of 64, attention 8:2 x 64, 8 experts top-2 of 256 with
#   a shared 256, vocab 8192.
# - qwen35-moe-h1024 (304 M parameters with its MTP layer, 289 M without): Qwen3.5-35B-A3B scaled down, in the
#   Qwen3.5-MoE checkpoint layout (HF `qwen3_5_moe`): hidden 1024 (half), 16 layers of the 3:1 pattern, GDN 8
#   key / 16 value heads of 64 (half the heads and half the head width), gated attention 8:2 x 128 (half the
#   heads and half the width, 1/4 of the dims rotary, theta 1e7), 32 experts top-4 (1/8 of the experts, half
#   the top-k), expert and shared intermediate 96 (sized so the whole is ~300 M), vocab 32768, untied lm_head.
WIDE = {
    "qwen3-next-h512": TINY.replace(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=8,
        layer_types=interval_pattern(8),
        mlp_only_layers=(),
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
    ),
    "qwen35-moe-h1024": ModelConfig(
        model_type="qwen3_5_moe_text",
        vocab_size=32768,
        hidden_size=1024,
        intermediate_size=96,
        num_hidden_layers=16,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        layer_types=interval_pattern(16),
        rope_theta=1e7,
        partial_rotary_factor=0.25,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=96,
        shared_expert_intermediate_size=96,
        num_mtp_layers=1,
        weight_layout="qwen3_5",
        trunk_prefix="model.language_model",
    ),
}


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of `cfg` (its MTP layer included), from the parameter specs alone."""
    return int(sum(math.prod(s.shape) for s in jax.tree_util.tree_leaves(param_specs(cfg), is_leaf=is_spec)))


def _pattern_name(name: str):
    """`qwen3-next-<L>L` or `qwen3-next-<L>L-i<interval>` -> (L, interval), else None."""
    if not name.startswith("qwen3-next-"):
        return None
    body, _, interval = name[len("qwen3-next-") :].partition("-i")
    if not body.endswith("L") or not body[:-1].isdigit() or (interval and not interval.isdigit()):
        return None
    return int(body[:-1]), int(interval or 4)


def config(name: str) -> ModelConfig:
    """The config of `model(name)` without building its weights."""
    if (p := _pattern_name(name)) is not None:
        return qwen3_next_pattern(*p)
    if name in SMALL or name in WIDE:
        return {**SMALL, **WIDE}[name]
    if name in PRESETS:
        return PRESETS[name][0]
    return load_model_config(name)


def model(name: str, dtype=jnp.float32):
    """(cfg, params) of a benchmark model: a preset (`tiny`), `tiny-2L`, `qwen3-next-h512`, `qwen3-next-<L>L[-i<n>]`
    (the Qwen3-Next pattern with L layers, full attention every n-th (default 4), at tiny width)
    or a checkpoint directory. Random weights are seeded (seed 0): the same bytes every run."""
    if _pattern_name(name) is not None or name in SMALL or name in WIDE:
        cfg = config(name)
        return cfg, init_params(cfg, 0, dtype)
    return resolve_checkpoint(name, "float32" if dtype == jnp.float32 else "bfloat16")


def settings(**flags):
    """EngineSettings from serve flags given as Python values (KV f32 unless given: the serve
    default, fp8, is lossy next to a float32 model and HF keeps its cache in float32)."""
    flags.setdefault("kv_cache_dtype", "f32")
    raw = {k: (str(v) if k == "max_batch_size" else v) for k, v in flags.items()}
    return resolve_settings(raw, None, auto_slots=int(flags.get("max_batch_size", 8)))


def weights_digest(cfg: ModelConfig, params) -> str:
    """sha256 of the config and every parameter leaf (path, dtype, shape, bytes)."""
    h = hashlib.sha256(json.dumps(cfg.to_hf_dict(), sort_keys=True).encode())
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        x = np.asarray(leaf)
        h.update(f"{jax.tree_util.keystr(path)} {x.dtype} {x.shape}".encode())
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()


def write_checkpoint(directory: str, cfg: ModelConfig, params) -> str:
    """Write `params` as an HF-loadable checkpoint in `directory`, unless the checkpoint there was
    written from the same config and weights (`weights_digest`, kept next to it).
    NOTE: keyed on the weights, not the model name: a seeded model's bytes change when the
    parameter tree does, and HF must never read an older version's weights (the table would
    compare two different models)."""
    digest = weights_digest(cfg, params)
    stamp = os.path.join(directory, "weights.sha256")
    if os.path.isfile(stamp) and os.path.isfile(os.path.join(directory, "model.safetensors")):
        with open(stamp) as f:
            if f.read().strip() == digest:
                return directory
    save_checkpoint(directory, cfg, params)
    with open(stamp, "w") as f:
        f.write(digest + "\n")
    return directory
