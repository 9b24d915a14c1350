"""The shipped `small` preset: its files, its training record, its tokenizer and training code,
and what it must show — in-distribution greedy text, speculative == greedy, first-draft
acceptance of at least 40 % on held-out code.

The engine runs share `research.study_for("small")` with test_research and the notebooks."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.ops import ReferenceOps
from metrale_jax import research
from metrale_jax.checkpoint import load_checkpoint
from metrale_jax.config import load_model_config
from metrale_jax.model_registry import SMALL, TINY
from metrale_jax.presets import resolve_checkpoint
from metrale_jax.presets_data import SMALL_DIR
from metrale_jax.tokenizer import END_OF_TEXT, ByteTokenizer, TokenizerError, load_tokenizer, tokenizer_for
from metrale_jax.training.chain import chain_logits, chain_metrics
from metrale_jax.training.corpus import is_validation_file, load_corpus, tiling_windows
from metrale_jax.training.objective import TrainOps, init_for_training, objective
from metrale_jax.training.recipe import SMALL_RECIPE

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def log():
    with open(os.path.join(SMALL_DIR, "training.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def heldout_run():
    """Flat 3-draft speculative decoding of 8 held-out prompts at width 8, and plain greedy."""
    study = research.study_for("small")
    prompts = research.heldout_prompts(8, 64, seed=3)
    return study.run(prompts, 32, research.flat_schedule(3), width=8), study.greedy(prompts, 32, width=8)


# ---------------------------------------------------------------- the shipped files


def test_shipped_checkpoint_is_the_recipe_and_small():
    assert load_model_config(SMALL_DIR) == SMALL
    assert os.path.getsize(os.path.join(SMALL_DIR, "model.safetensors")) <= 20 * 2**20
    cfg, params = load_checkpoint(SMALL_DIR)
    assert cfg.num_linear_layers and cfg.num_full_layers and cfg.num_mtp_layers == 1
    assert any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    assert not all(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    assert "mtp" in params
    assert load_tokenizer(SMALL_DIR).vocab_size == cfg.vocab_size


def test_small_is_a_preset():
    cfg, params = resolve_checkpoint("small")
    assert cfg == SMALL and params["embed"].dtype == jnp.float32


def test_training_record(log):
    train, val, final = log["curve"]["train"], log["curve"]["val"], log["final_val"]
    assert train[-1]["step"] == log["recipe"]["steps"] == SMALL_RECIPE.steps
    assert train[-1]["loss"] < 0.5 * train[0]["loss"]
    assert val[-1]["loss"] < val[0]["loss"]
    assert 1.0 < final["ppl"] < 5.0  # a byte unigram model of this text is ~22
    assert log["engine_acceptance"]["by_position"][0] >= 0.4
    assert log["train_seconds"] <= 25 * 60
    with open(os.path.join(SMALL_DIR, "TRAINING.md")) as f:
        assert f"{final['ppl']:.3f}" in f.read()


# ---------------------------------------------------------------- what the model must show


def test_speculative_equals_greedy(heldout_run):
    run, greedy = heldout_run
    assert run.tokens == greedy
    assert all(len(t) == 32 for t in greedy)


def test_first_draft_acceptance_on_heldout_code(heldout_run):
    run, _ = heldout_run
    assert run.acceptance_by_position()[0] >= 0.4


def test_greedy_continuation_is_python_like():
    study = research.study_for("small")
    prompt = "import os\nimport sys\n\n\ndef main(argv):\n    "
    out = TOK.decode(study.greedy([TOK.encode(prompt)], 48)[0])
    printable = sum(c.isprintable() or c in "\n\t" for c in out)
    assert printable == len(out)
    assert any(k in out for k in ("(", "=", ":", "return", "if ")), out


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_and_specials(tmp_path):
    text = "def f(x):\n    return 'é' + \"\\u2603\"  # ☃\n"
    assert TOK.decode(TOK.encode(text)) == text
    assert max(TOK.encode(text)) < 256 and TOK.vocab_size == 257 and TOK.eos_id == 256
    assert TOK.decode([104, 105, 256, 0xE2]) == "hi" + END_OF_TEXT + "\ufffd"
    TOK.save(str(tmp_path))
    assert load_tokenizer(str(tmp_path)) == TOK
    assert tokenizer_for(None, TINY.vocab_size).vocab_size == 256
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        TOK.decode([300])
    with pytest.raises(TokenizerError, match="< 256"):
        tokenizer_for(None, 100)
    (tmp_path / "tokenizer.json").write_text('{"type": "bpe"}')
    with pytest.raises(TokenizerError, match="byte-level"):
        load_tokenizer(str(tmp_path))


# ---------------------------------------------------------------- training code


def test_corpus_split_is_by_name_and_windows_tile(tmp_path):
    for i in range(30):
        (tmp_path / f"m{i}.py").write_text(f"x = {i}\n" * 40)
    corpus = load_corpus(str(tmp_path), TOK, 5)
    held = {f"m{i}.py" for i in range(30) if is_validation_file(f"m{i}.py", 5)}
    assert set(corpus.val_files) == held and held.isdisjoint(corpus.train_files)
    assert corpus.train_files and (corpus.val == TOK.eos_id).sum() == len(held)
    w = tiling_windows(corpus.train, 16)
    assert w.shape[1] == 18 and (w[1:, 0] == w[:-1, 16]).all()


def test_train_ops_compute_the_reference_math():
    """TrainOps' attention (all keys at once) and 16-row GDN chunk equal the engine's reference."""
    rng = np.random.default_rng(0)
    f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    q, kc, vc = f32(2, 5, 4, 8), f32(5, 4, 2, 8), f32(5, 4, 2, 8)
    tables = jnp.asarray([[0, 1, 2], [3, 4, 4]], jnp.int32)
    positions = jnp.asarray([[3, 4, 5, 6, 7], [0, 1, 2, 3, -1]], jnp.int32)
    attend = lambda ops: jax.jit(lambda *a: ops.attention(*a, 0.3))(q, kc, vc, tables, positions)
    np.testing.assert_allclose(attend(TrainOps()), attend(ReferenceOps()), atol=1e-5)
    l2 = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    qk, v = l2(f32(1, 40, 2, 8)), f32(1, 40, 4, 8)
    g, beta, h0 = -jnp.abs(f32(1, 40, 4)) * 0.1, jax.nn.sigmoid(f32(1, 40, 4)), f32(1, 4, 8, 8)
    chunked = lambda ops: jax.jit(ops.gdn_chunk)(qk, qk, v, g, beta, h0)
    for got, want in zip(chunked(TrainOps()), chunked(ReferenceOps())):
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_objective_gradient_lowers_both_losses():
    cfg = TINY.replace(
        vocab_size=257,
        num_hidden_layers=2,
        layer_types=TINY.layer_types[:2],
        num_experts=0,
        num_experts_per_tok=0,
        mlp_only_layers=(),
    )
    params = init_for_training(cfg, 0)
    windows = jnp.asarray(np.tile(np.arange(18, dtype=np.int32) % 5 + 97, (2, 1)))

    @jax.jit
    def descend(p):
        (_, m), g = jax.value_and_grad(objective, has_aux=True)(p, cfg, windows, 0.5)
        return jax.tree_util.tree_map(lambda w, d: w - 0.05 * d, p, g), m

    params, before = descend(params)
    for _ in range(3):
        params, after = descend(params)
    assert after["loss"] < before["loss"] and after["mtp_loss"] < before["mtp_loss"]


def test_the_chained_fine_tune_sees_the_engines_propose():
    """`chain_logits` at one base equals the engine's propose of 3 chained drafts there: the same
    drafts (argmax) and confidences (log-softmax at the draft) within float rounding (TrainOps'
    16-row GDN chunk and dense attention against the engine's kernels)."""
    study = research.study_for("small")
    eng, cfg, params = study.engine, study.cfg, study.params
    prompt = research.heldout_prompts(1, 40, seed=5)[0]
    seq = eng.alloc_sequence()
    try:
        last = int(np.argmax(eng.prefill(seq, prompt)))
        drafts, conf, _ = eng.propose_batched([seq], [last], 3)
    finally:
        eng.free_sequence(seq)
    window = jnp.asarray([[*prompt, last, *drafts[0, :2].tolist()]], jnp.int32)
    _, chained = jax.jit(chain_logits, static_argnames=("cfg", "depth"))(params["mtp"], params, cfg, window, 3)
    at = len(prompt) - 1
    lsm = [jax.nn.log_softmax(out[0, at]) for out in chained]
    assert [int(jnp.argmax(x)) for x in lsm] == drafts[0].tolist()
    np.testing.assert_allclose([float(x[d]) for x, d in zip(lsm, drafts[0])], conf[0], atol=1e-4)


def test_the_chained_fine_tune_moves_only_the_drafter_and_lowers_its_chained_loss():
    cfg = TINY.replace(vocab_size=257)
    params = init_for_training(cfg, 0)
    windows = jnp.asarray(np.tile(np.arange(19, dtype=np.int32) % 5 + 97, (2, 1)))
    loss = lambda mtp: chain_metrics(mtp, params, cfg, windows, 3)["loss"]
    grads = jax.jit(jax.grad(lambda p: chain_metrics(p["mtp"], p, cfg, windows, 3)["loss"].sum()))(params)
    assert all(not np.asarray(g).any() for k, g in grads.items() if k != "mtp" for g in jax.tree_util.tree_leaves(g))
    step = jax.jit(lambda m: jax.tree_util.tree_map(lambda w, d: w - 0.05 * d, m, jax.grad(lambda x: loss(x).sum())(m)))
    before, mtp = loss(params["mtp"]), params["mtp"]
    for _ in range(4):
        mtp = step(mtp)
    assert (loss(mtp) < before).all()
