"""Configs Hugging Face accepts load here too, and compute what HF computes.

`qwen3_5_odd_rotary` (tests/fixtures/hf, made by scripts/make_hf_fixtures.sh): a Qwen3.5 dense
model with head_dim 20 and partial_rotary_factor 0.25, so rotary dimension 5, which the config
check used to refuse as "must be even". transformers rotates 2 * ceil(5 / 2) = 6 channels with
the frequencies theta^(-2i/5), i = 0, 2, 4; the golden logits are its prefill + cached decode.
"""

import os

import jax.numpy as jnp
import numpy as np
from conftest import FIXTURES

from metrale_jax.checkpoint import load_checkpoint
from metrale_jax.model.cache import prefill_and_decode

ODD = os.path.join(FIXTURES, "hf", "qwen3_5_odd_rotary")


def _run(dtype):
    g = np.load(os.path.join(ODD, "golden.npz"))
    p, toks = int(g["prompt_len"]), g["tokens"]
    cfg, params = load_checkpoint(ODD, dtype)
    lg, _ = prefill_and_decode(params, cfg, toks[:p], len(toks) - p, feed=toks[p:])
    return cfg, np.asarray(lg), g


def test_odd_rotary_dim_loads_and_matches_hf_in_float32():
    cfg, lg, g = _run(np.float32)
    assert (cfg.head_dim, cfg.rotary_dim, cfg.rotary_width) == (20, 5, 6)
    ref = g["logits_f32"]
    assert np.abs(lg - ref).max() <= 1e-4 * np.abs(ref).max()


def test_odd_rotary_dim_tracks_hf_in_bfloat16():
    _, lg, g = _run(jnp.bfloat16)
    assert np.median(np.abs(lg - g["logits_bf16"])) <= 0.06
    assert np.mean(lg.argmax(1) == g["logits_bf16"].argmax(1)) >= 0.9
