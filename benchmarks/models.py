"""The weights and serve settings the benchmarks run, and the checkpoint both sides load (the configs
are `metrale_jax.model_registry`'s: `config` names them).

Owns: `model` (a named model's config and weights), `parameter_count`, `settings`
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
from metrale_jax.config import ModelConfig
from metrale_jax.engine.settings import resolve_settings
from metrale_jax.model_registry import config, is_synthetic
from metrale_jax.params import init_params, is_spec, param_specs
from metrale_jax.presets import resolve_checkpoint


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of `cfg` (its MTP layer included), from the parameter specs alone."""
    return int(sum(math.prod(s.shape) for s in jax.tree_util.tree_leaves(param_specs(cfg), is_leaf=is_spec)))


def model(name: str, dtype=jnp.float32):
    """(cfg, params) of a benchmark model: a preset (`tiny`, `small`), a name of `model_registry.config`
    (`tiny-2L`, `qwen3-next-h512`, `qwen3-next-<L>L[-i<n>]`, ...) or a checkpoint directory. A synthetic
    model's random weights are seeded (seed 0): the same bytes every run."""
    if is_synthetic(name):
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
