"""Embedded models usable wherever a checkpoint directory is (`--checkpoint tiny`).

Owns: the presets (name -> config and seed, or shipped folder; the configs are
`metrale_jax.model_registry`'s) and `resolve_checkpoint`, the one function every command uses to turn a
`--checkpoint` value (preset name, directory, or a hub id with a snapshot in the local Hugging Face
cache: `metrale_jax.hub_cache`) into (config, params).
Invariant: a preset's weights are the same bytes on every process and machine, and nothing is
downloaded: seeded presets (`tiny`) are a pure function of their name and dtype, shipped presets
(`small`, trained by scripts/train_small.py) are read from the package's own files.
"""

from __future__ import annotations

import jax.numpy as jnp

from metrale_jax.checkpoint import CheckpointError, load_checkpoint
from metrale_jax.hub_cache import checkpoint_directory, hub_cache_dir
from metrale_jax.model_registry import TINY
from metrale_jax.params import init_params
from metrale_jax.presets_data import PRESET_DIRS

PRESETS = {"tiny": (TINY, 0)}

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def parse_dtype(name: str):
    try:
        return _DTYPES[name]
    except KeyError:
        raise CheckpointError(f"unknown dtype {name!r} (choose from {', '.join(_DTYPES)})") from None


def resolve_checkpoint(name_or_dir: str, dtype: str | None = "float32"):
    """(config, params) for a preset name or a checkpoint directory, cast to `dtype` (None: a
    checkpoint's own, `checkpoint.declared_dtype`; presets default to float32). Raises CheckpointError."""
    if name_or_dir in PRESETS:
        cfg, seed = PRESETS[name_or_dir]
        return cfg, init_params(cfg, seed, parse_dtype(dtype or "float32"))
    if name_or_dir in PRESET_DIRS:
        return load_checkpoint(PRESET_DIRS[name_or_dir], parse_dtype(dtype or "float32"))
    directory = checkpoint_directory(name_or_dir)
    if directory is None:
        raise CheckpointError(
            f"--checkpoint {name_or_dir!r} is neither a preset ({', '.join([*PRESETS, *PRESET_DIRS])}), a directory "
            f"nor a model in the Hugging Face cache ({hub_cache_dir()})"
        )
    return load_checkpoint(directory, None if dtype is None else parse_dtype(dtype))
