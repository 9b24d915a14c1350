"""Every named model of the project, defined once: the presets' architectures, the benchmark models,
the layer-pattern stacks, the sharded check's model and the HF fixtures' specs.

Owns: `TINY` (the seeded `tiny` preset), `SMALL` (the shipped `small` preset's architecture; its
config.json must equal `SMALL.to_hf_dict()`, a test checks it), `interval_pattern`,
`qwen3_next_pattern` (the Qwen3-Next-80B layer pattern at any depth, tiny width), `qwen35_stack`
(a Qwen3.5-35B-A3B layer stack, full or tiny width), `STAND_INS` (two-layer stand-ins the smoke
runs use), `WIDE` (the 45 M and 300 M benchmark models), `SHARDED_TINY` (tiny widened so tp 4
divides its heads), `HF_FIXTURES` (the golden fixtures' own random configs, as plain HF-style
dicts) and `config` (a name -> its `ModelConfig`).

Invariants:
- Plain data: this module imports nothing but `metrale_jax.config` (no jax, no numpy), so the HF
  fixture script's Python 3.11 venv (torch, no jax) reads `HF_FIXTURES` from here.
- A name means one config everywhere; values here are what fixtures, presets_data and tests were
  built from, so changing one changes those artefacts.
- Weights are not made here: `metrale_jax.presets` resolves presets (seeded or shipped), and the
  synthetic names (`is_synthetic`) are seeded by whoever builds them (seed 0 in the benchmarks).
"""

from __future__ import annotations

from metrale_jax.config import FULL, LINEAR, ModelConfig, load_model_config

# A small Qwen3-Next-shaped model: both mixer kinds, MoE layers and one dense layer
# (mlp_only_layers), GQA 2:1, linear value heads != key heads, dk != dv, one MTP layer.
TINY = ModelConfig(
    model_type="qwen3_next",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    layer_types=(LINEAR, FULL, LINEAR, FULL),
    rope_theta=10000.0,
    partial_rotary_factor=0.5,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=32,
    mlp_only_layers=(1,),
    num_mtp_layers=1,
)

# The shipped `small` preset (trained by `make train-small`): Qwen3-Next-like at toy scale, three
# Gated-DeltaNet layers and one gated-attention layer (3:1), MoE feed-forward in layers 1 and 3 and
# dense in 0 and 2, GQA 2:1, more GDN value heads than key heads, one MTP layer (dense: it follows
# layer 0), a byte vocabulary plus <|endoftext|>. About 1.2 M parameters, 4.7 MB in float32.
SMALL = ModelConfig(
    model_type="qwen3_next",
    vocab_size=257,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    layer_types=(LINEAR, LINEAR, LINEAR, FULL),
    rope_theta=10000.0,
    partial_rotary_factor=0.5,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=128,
    mlp_only_layers=(0, 2),
    num_mtp_layers=1,
)


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


# Small models for the smoke runs (compile time grows with the layer count):
# tiny-2L: the tiny preset's first two layers (GDN + MoE, attention + dense MLP); qwen35-moe-2L: the same two
# mixers, both with MoE, in the Qwen3.5-MoE checkpoint layout (the smoke run's stand-in for qwen35-moe-h1024).
STAND_INS = {
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

# The sharded check's model: the tiny preset widened to 4 attention KV heads and 4 GDN key heads, so
# tensor parallel 4 divides it (its weights: seed 1).
SHARDED_TINY = TINY.replace(num_key_value_heads=4, linear_num_key_heads=4, linear_num_value_heads=8)

# The golden HF fixtures' random configs (tests/fixtures/hf/<name>), in HF's terms: "family" is qwen3_next
# (flat config) or qwen3_5 / qwen3_5_moe (the VLM wrapper); "seed" draws the weights. The fixture script
# writes config.json from these, so the fixtures' config.json files are their record.
HF_FIXTURES: dict[str, dict] = {
    "qwen3_next_moe": dict(
        family="qwen3_next",
        seed=2008,
        vocab_size=160,
        hidden_size=64,
        num_hidden_layers=4,
        full_attention_interval=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        partial_rotary_factor=0.25,
        rope_theta=10000000,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        linear_conv_kernel_dim=4,
        intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[2],
        tie_word_embeddings=False,
    ),
    "qwen3_next_dense": dict(
        family="qwen3_next",
        seed=2006,
        vocab_size=192,
        hidden_size=64,
        num_hidden_layers=4,
        full_attention_interval=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        partial_rotary_factor=0.5,
        rope_theta=10000,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        intermediate_size=40,
        num_experts=0,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
    ),
    "qwen3_5_dense": dict(
        family="qwen3_5",
        seed=2025,
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=4,
        full_attention_interval=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        partial_rotary_factor=0.5,  # rotary dim 8 -> 4 frequency slots = sum(mrope_section)
        rope_theta=10000000,
        mrope_section=[2, 1, 1],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        linear_conv_kernel_dim=4,
        intermediate_size=96,
        tie_word_embeddings=True,
    ),
    "qwen3_5_moe": dict(
        family="qwen3_5_moe",
        seed=2036,
        vocab_size=200,
        hidden_size=64,
        num_hidden_layers=4,
        full_attention_interval=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        partial_rotary_factor=0.25,  # rotary dim 8 -> 4 frequency slots = sum(mrope_section)
        rope_theta=10000000,
        mrope_section=[2, 1, 1],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        tie_word_embeddings=False,
    ),
}

# An odd rotary dimension, which transformers accepts: head_dim 20 x 0.25 = 5 gives the frequencies
# theta^(-2i/5) for i = 0, 2, 4, so 3 slots (sum(mrope_section)) and 6 rotated channels.
HF_FIXTURES["qwen3_5_odd_rotary"] = {
    **HF_FIXTURES["qwen3_5_dense"],
    "seed": 2050,
    "head_dim": 20,
    "partial_rotary_factor": 0.25,
    "mrope_section": [1, 1, 1],
    "tie_word_embeddings": False,
}

#: The presets' architectures by preset name (their weights: `metrale_jax.presets`).
PRESET_CONFIGS = {"tiny": TINY, "small": SMALL}


def _pattern(name: str) -> tuple[int, int] | None:
    """`qwen3-next-<L>L` or `qwen3-next-<L>L-i<interval>` -> (L, interval), else None."""
    if not name.startswith("qwen3-next-"):
        return None
    body, _, interval = name[len("qwen3-next-") :].partition("-i")
    if not body.endswith("L") or not body[:-1].isdigit() or (interval and not interval.isdigit()):
        return None
    return int(body[:-1]), int(interval or 4)


def is_synthetic(name: str) -> bool:
    """Whether `name` is a model with no weights of its own (a stand-in, a wide model or a pattern):
    its builder seeds them."""
    return name in STAND_INS or name in WIDE or _pattern(name) is not None


def config(name: str) -> ModelConfig:
    """The config of a named model: a preset (`tiny`, `small`), a stand-in (`tiny-2L`, `qwen35-moe-2L`),
    a wide model (`qwen3-next-h512`, `qwen35-moe-h1024`), `qwen3-next-<L>L[-i<n>]` (the Qwen3-Next
    pattern with L layers, full attention every n-th (default 4), at tiny width), or else the
    config.json of a checkpoint directory."""
    if (p := _pattern(name)) is not None:
        return qwen3_next_pattern(*p)
    named = {**PRESET_CONFIGS, **STAND_INS, **WIDE}
    if name in named:
        return named[name]
    return load_model_config(name)
