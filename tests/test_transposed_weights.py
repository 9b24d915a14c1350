"""The input-major weight layout (`metrale_jax.model.linear.TransposedWeight`): the same values as
the [out, in] weight, products equal to float64 within float32 rounding at every row count and for
every expert form, rows isolated (NaN included), and the single-device CPU engine holding its
projections input-major and handing them back in checkpoint order when it is resharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import settings

from metrale_jax.engine.engine import Engine
from metrale_jax.model import linear as lin
from metrale_jax.model import mlp
from metrale_jax.model.layer_groups import arrange_layers, layer_groups
from metrale_jax.model.weight_layout import checkpoint_layout
from metrale_jax.model_registry import TINY
from metrale_jax.params import init_params
from metrale_jax.presets import resolve_checkpoint

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("shape", [(64, 32), (100, 48), (3, 128, 16), (2, 4, 192, 8)])
def test_the_layout_round_trips(shape):
    w = jnp.asarray(RNG.standard_normal(shape), jnp.float32)
    t = lin.TransposedWeight.of(w)
    assert t.shape == shape and t.dtype == w.dtype
    assert t.t.shape == (*shape[:-2], shape[-1], shape[-2])
    np.testing.assert_array_equal(t.weight(), w)


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 33, 200])
@pytest.mark.parametrize("out", [64, 150])
def test_an_input_major_product_is_the_product(rows, out):
    """Against float64, lead axes kept."""
    x = jnp.asarray(RNG.standard_normal((1, rows, 96)), jnp.float32)
    w = jnp.asarray(RNG.standard_normal((out, 96)), jnp.float32)
    got = np.asarray(jax.jit(lin.linear)(x, lin.TransposedWeight.of(w)))
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    assert got.shape == (1, rows, out)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("layout", ["[out, in]", "[in, out]"])
@pytest.mark.parametrize("rows", [3, 67])
def test_expert_products_are_the_products_in_both_layouts(layout, rows):
    """`linear_per_expert`, `linear_all_experts` and one `expert_weight` against float64."""
    x = jnp.asarray(RNG.standard_normal((4, rows, 32)), jnp.float32)
    w = jnp.asarray(RNG.standard_normal((4, 96, 32)), jnp.float32)
    laid = w if layout == "[out, in]" else lin.TransposedWeight.of(w)
    ref = np.einsum("eci,eoi->eco", np.asarray(x, np.float64), np.asarray(w, np.float64))
    tol = 1e-5 * np.abs(ref).max()
    np.testing.assert_allclose(jax.jit(lin.linear_per_expert)(x, laid), ref, rtol=0, atol=tol)
    every = jax.jit(lin.linear_all_experts)(x[0], laid)
    assert every.shape == (rows, 4, 96)
    np.testing.assert_allclose(every, np.einsum("ri,eoi->reo", np.asarray(x[0], np.float64), w), rtol=0, atol=tol)
    one = jax.jit(lambda x, w, e: lin.linear(x, lin.expert_weight(w, e)))(x[2], laid, 2)
    np.testing.assert_allclose(one, ref[2], rtol=0, atol=tol)


@pytest.mark.parametrize("rows", [6, 70])
def test_input_major_rows_are_isolated_nan_included(rows):
    w = lin.TransposedWeight.of(jnp.asarray(RNG.standard_normal((130, 40)), jnp.float32))
    x = jnp.asarray(RNG.standard_normal((rows, 40)), jnp.float32)
    f = jax.jit(lin.linear)
    ref = np.asarray(f(x, w))
    got = np.asarray(f(x.at[1::2].set(jnp.nan), w))
    np.testing.assert_array_equal(got[::2], ref[::2])
    assert np.isnan(got[1::2]).all()


def test_the_cpu_engine_holds_its_projections_input_major_and_reshards_them_in_checkpoint_order():
    cfg, params = resolve_checkpoint("tiny")
    eng = Engine(cfg, params, settings(max_batch_size=2, max_seq_len=64, speculative=True, num_drafts=2))
    assert lin.transposed_layout_applies(None)
    is_t = lambda x: isinstance(x, lin.TransposedWeight)  # noqa: E731
    held = {
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_flatten_with_path(eng.params, is_leaf=is_t)[0]
        if is_t(leaf)
    }
    expected = {
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
        if path[-1].key in lin.TRANSPOSED_LEAVES and leaf.ndim >= 2
    }
    assert held == expected and any("lm_head" in k for k in held) and any("gate_up" in k for k in held)
    back = lin.untranspose_weights(eng.params)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("layout", ["list", "scan"])
def test_the_cpu_engine_holds_experts_one_leaf_each_where_one_row_runs_pairs(monkeypatch, layout):
    """A model whose one-row MoE step runs `pairs` (`mlp.expert_leaves_apply`): the engine holds each
    expert stack one leaf per expert, hands the stacks back in checkpoint order, and computes what an
    engine holding the stacks computes: prefill logits within float32 rounding (`dense` / `grouped`
    run expert by expert instead of batched over the experts), then decodes the same tokens."""
    cfg = TINY.replace(
        num_hidden_layers=4, layer_types=TINY.layer_types[:2] * 2, mlp_only_layers=(), moe_intermediate_size=1408
    )
    assert mlp.expert_leaves_apply(cfg) and layer_groups(cfg) == 2
    params = init_params(cfg, 1)
    flags = settings(max_batch_size=1, max_seq_len=64)
    eng = Engine(cfg, params, flags, layout=layout)
    blocks = eng.params["layers"] if layout == "list" else eng.params["layer_groups"]
    moe_blocks = [b["mlp"] for b in blocks]
    assert all(isinstance(b[k], lin.ExpertLeaves) for b in moe_blocks for k in ("gate_up", "down"))
    arranged = jax.tree_util.tree_leaves(arrange_layers(params, cfg, layout))
    for a, b in zip(jax.tree_util.tree_leaves(checkpoint_layout(eng.params)), arranged, strict=True):
        np.testing.assert_array_equal(a, b)
    monkeypatch.setattr("metrale_jax.model.weight_layout.expert_leaves_apply", lambda cfg: False)
    stacked = Engine(cfg, params, flags, layout=layout)
    prompt = RNG.integers(0, cfg.vocab_size, 24).tolist()
    outs = []
    for e in (eng, stacked):
        seq = e.alloc_sequence()
        logits = [e.prefill(seq, prompt)]
        for _ in range(4):
            logits.append(e.decode(seq, int(np.argmax(logits[-1]))))
        outs.append(np.stack(logits))
    np.testing.assert_allclose(outs[0], outs[1], rtol=0, atol=1e-5 * np.abs(outs[1]).max())
    assert (outs[0].argmax(-1) == outs[1].argmax(-1)).all()
