"""The small model's training recipe: every training hyperparameter, stated once.

Owns: `TrainRecipe` (every training choice `scripts/train_small.py` makes; recorded in the training
log beside the model) and `SMALL_RECIPE` (the committed run's). The architecture it trains is
`metrale_jax.model_registry.SMALL`.
"""

from __future__ import annotations

import dataclasses


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
