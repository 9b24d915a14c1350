"""Parity with Hugging Face transformers on golden fixtures (tests/fixtures/hf, made by
scripts/make_hf_fixtures.sh with transformers 5.24 + torch 2.13 CPU): 133-token prefills crossing
two 64-token chunks, then 16 cached decode steps, for Qwen3-Next MoE / dense and Qwen3.5 dense /
MoE, in float32 (tight) and bfloat16 (statistical: HF's own bf16 run differs from its f32 run by
up to 2.2 logits on single rows, from routing flips)."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import settings
from hf_golden import assert_bfloat16_tracks_hf, assert_float32_parity, golden, replayed_logits

from metrale_jax.checkpoint import load_checkpoint
from metrale_jax.engine.engine import Engine

NAMES = ["qwen3_next_moe", "qwen3_next_dense", "qwen3_5_dense", "qwen3_5_moe"]


@pytest.mark.parametrize("name", NAMES)
def test_float32_logits_match_hf_at_every_position(name):
    g = golden(name)
    assert_float32_parity(g, replayed_logits(g, np.float32)[2])


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_logits_track_hf(name):
    g = golden(name)
    assert_bfloat16_tracks_hf(g, replayed_logits(g, jnp.bfloat16)[2])


def test_engine_paged_chunked_prefill_and_decode_match_hf():
    """The engine (paged KV, chunked prefill of 48 tokens, bucketed shapes) reproduces HF too."""
    g = golden("qwen3_next_moe")
    p, toks = g.prompt_len, g.tokens
    cfg, params = load_checkpoint(g.folder, np.float32)
    eng = Engine(cfg, params, settings(max_batch_size=2, max_seq_len=256, max_prefill_tokens=48))
    seq = eng.alloc_sequence()
    rows = [eng.prefill(seq, toks[:p])]
    rows += [eng.decode(seq, int(t)) for t in toks[p:]]
    ref = g.logits_f32[p - 1 :]
    err = np.abs(np.stack(rows) - ref).max()
    assert err <= 1e-4 * np.abs(ref).max()
