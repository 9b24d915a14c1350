"""The small model's recipe: architecture and training hyperparameters, stated once.

Owns: `SMALL_CONFIG` (the shipped model's `ModelConfig`; its config.json must equal
`SMALL_CONFIG.to_hf_dict()`, a test checks it) and `TrainRecipe` (every training choice
`scripts/train_small.py` makes; recorded in the training log beside the model).

Shape: Qwen3-Next-like at toy scale — three Gated-DeltaNet layers and one gated-attention layer
(the 3:1 ratio), MoE feed-forward in layers 1 and 3 and dense in 0 and 2 (`mlp_only_layers`),
GQA 2:1, more GDN value heads than key heads, one MTP layer (dense: it follows layer 0), a byte
vocabulary plus <|endoftext|>. About 1.2 M parameters, 4.7 MB in float32.
"""

from __future__ import annotations

import dataclasses

from metrale_jax.config import FULL, LINEAR, ModelConfig

SMALL_CONFIG = ModelConfig(
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


@dataclasses.dataclass(frozen=True)
class TrainRecipe:
    """Every choice of a training run (all plain values; `dataclasses.asdict` goes in the log).

    Batches are `batch` random windows of `seq_len + 2` tokens of the training split: the trunk
    reads `seq_len` tokens, predicts the next one at each position, and the MTP head predicts the
    one after (so two extra targets). AdamW with linear warm-up then cosine decay to
    `final_lr_frac * lr`, global-norm clipping. Validation: `eval_windows` fixed windows every
    `eval_every` steps (the curve), all held-out text at the end (the reported perplexity).

    Then the drafter's chained fine-tune (`training/chain.py`): `chain_steps` steps of Adam on the
    MTP parameters alone, over `chain_depth` chained drafts of windows of `chain_seq_len` bases, the
    depth losses weighted by `chain_weights` (0 steps: no fine-tune).
    """

    steps: int = 520
    batch: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    warmup: int = 50
    final_lr_frac: float = 0.1
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    mtp_weight: float = 0.5
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100
    eval_windows: int = 32
    val_every_nth_file: int = 20
    chain_steps: int = 300
    chain_depth: int = 3
    chain_seq_len: int = 128
    chain_lr: float = 1e-3
    chain_warmup: int = 20
    chain_weights: tuple[float, ...] = (1.0, 1.0, 1.0)


SMALL_RECIPE = TrainRecipe()
