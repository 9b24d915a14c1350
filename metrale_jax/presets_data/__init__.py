"""Checkpoints shipped inside the package, selectable as presets by directory.

Owns: where each shipped checkpoint lives. `small` (`small/`): the byte-level Qwen3-Next-shaped
model with an MTP head trained by `scripts/train_small.py` (config.json, model.safetensors,
tokenizer.json, training.json and TRAINING.md with its loss curve and held-out numbers).
Invariant: every directory here loads with `metrale_jax.checkpoint.load_checkpoint`.
"""

from __future__ import annotations

import os

SMALL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "small")

#: Preset name -> checkpoint directory, for `metrale_jax.presets.resolve_checkpoint`.
PRESET_DIRS = {"small": SMALL_DIR}
