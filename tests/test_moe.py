"""The sparse MoE block: its three forms against transformers' eager expert loop (float64), each
other and themselves, the form each shape takes, and row isolation (NaN rows included)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.model import mlp
from metrale_jax.model.linear import ExpertLeaves, TransposedWeight, transpose_weights
from metrale_jax.model_registry import TINY, config
from metrale_jax.params import init_params, moe_router_rows

FORMS = ("dense", "pairs", "grouped")
# TINY's MoE (8 experts, top-2) at a width where the products are not trivially exact.
CFG = TINY.replace(num_hidden_layers=1, layer_types=TINY.layer_types[:1], mlp_only_layers=(), num_mtp_layers=0)


@pytest.fixture(scope="module")
def p():
    return init_params(CFG, 3)["layers"][0]["mlp"]


LAYOUTS = ("[out, in]", "[in, out]", "[out, in] per expert", "[in, out] per expert")


@pytest.fixture(scope="module", params=LAYOUTS)
def laid_out(request, p):
    """The block's weights in each layout an engine runs: [out, in] leaves, input-major (the
    single-device XLA CPU engine's: `linear.transpose_weights`), and either with the expert stacks
    one leaf per expert (`mlp.split_expert_stacks`, where `mlp.expert_leaves_apply`)."""
    w = transpose_weights(p) if request.param.startswith("[in, out]") else p
    assert isinstance(w["gate_up"], TransposedWeight) == request.param.startswith("[in, out]")
    if request.param.endswith("per expert"):
        w = mlp.split_expert_stacks(w)
        assert isinstance(w["gate_up"], ExpertLeaves) and len(w["down"].experts) == CFG.num_experts
        assert w["gate_up"].shape == p["gate_up"].shape and w["down"].dtype == p["down"].dtype
    return w


@pytest.mark.parametrize("rows", [1, 4])
def test_pairs_per_expert_leaves_are_the_stacked_pairs_bit_for_bit(p, rows):
    """The `pairs` form over one leaf per expert (a switch reading the expert in place) gives the
    bytes of the same form over the stack (the expert copied out): the same products."""
    x = jax.random.normal(jax.random.key(rows), (1, rows, CFG.hidden_size), jnp.float32)
    for stacked in (p, transpose_weights(p)):
        np.testing.assert_array_equal(_moe(mlp.split_expert_stacks(stacked), x, "pairs"), _moe(stacked, x, "pairs"))


def test_expert_leaves_apply_where_one_row_runs_pairs_and_join_back(p):
    """Per-expert leaves for the realistic-width models whose one-row step runs `pairs`; not for
    the small models (`dense` at one row) nor past EXPERT_LEAVES_MAX_EXPERTS (a switch that wide).
    Joined back, the leaves are the stacks."""
    wide = config("qwen3-next-h512")
    assert mlp.expert_leaves_apply(wide) and mlp.expert_leaves_apply(config("qwen35-moe-h1024"))
    assert not mlp.expert_leaves_apply(CFG) and mlp.moe_form(1, CFG) == "dense"
    assert not mlp.expert_leaves_apply(wide.replace(num_experts=2 * mlp.EXPERT_LEAVES_MAX_EXPERTS))
    for stacked in (p, transpose_weights(p)):
        tree = {"layers": [{"mlp": stacked}, {"mlp": {"gate_up": stacked["shared_gate_up"]}}]}
        back = mlp.join_expert_stacks(mlp.split_expert_stacks(tree))
        assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(tree)
        for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(tree)):
            np.testing.assert_array_equal(a, b)


def _moe(p, x, form):
    """`mlp.moe` with its form forced."""
    return np.asarray(jax.jit(lambda p, x: mlp.moe(p, x, CFG, form))(p, x))


def _hf_loop(p, x):
    """transformers' eager Qwen3-Next MoE in float64: per row, the top-k of the router softmax
    (renormalised), experts summed in index order, plus the sigmoid-gated shared expert."""
    w = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = np.asarray(x, np.float64).reshape(-1, CFG.hidden_size)
    router, ss = np.split(x @ w["router"].T, np.cumsum(moe_router_rows(CFG))[:-1], axis=-1)
    sg, su = np.split(x @ w["shared_gate_up"].T, 2, axis=-1)
    probs = np.exp(router - router.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    inter = CFG.moe_intermediate_size
    out = np.zeros_like(x)
    for r in range(len(x)):
        top = np.argsort(-probs[r], kind="stable")[: CFG.num_experts_per_tok]
        weights = probs[r, top] / probs[r, top].sum()
        for e, wt in sorted(zip(top, weights)):
            gu = w["gate_up"][e] @ x[r]
            out[r] += wt * (w["down"][e] @ (gu[:inter] / (1 + np.exp(-gu[:inter])) * gu[inter:]))
    silu = sg / (1 + np.exp(-sg))
    return out + (silu * su) @ w["shared_down"].T / (1 + np.exp(-ss))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_every_form_is_the_eager_expert_loop(p, laid_out, form, rows):
    x = jax.random.normal(jax.random.key(rows), (1, rows, CFG.hidden_size), jnp.float32)
    ref = _hf_loop(p, x).reshape(x.shape)
    got = _moe(laid_out, x, form)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * np.abs(ref).max())


def test_grouped_takes_more_rounds_when_the_load_is_skewed(p):
    """Every row routed to the same two experts: those experts get every row, many times the
    capacity of one round; the rounds continue until each has run."""
    x = jnp.tile(jax.random.normal(jax.random.key(0), (1, 1, CFG.hidden_size)), (1, 64, 1))
    x = x + 1e-3 * jax.random.normal(jax.random.key(1), x.shape)
    assert 64 > mlp.grouped_capacity(64, CFG)
    ref = _moe(p, x, "dense")
    np.testing.assert_allclose(_moe(p, x, "grouped"), ref, rtol=0, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("form", FORMS)
def test_rows_are_isolated_nan_included(laid_out, form):
    """A row's output bytes do not depend on the other rows: rows in another order come out in
    that order, and NaN in other rows changes nothing."""
    x = jax.random.normal(jax.random.key(5), (1, 16, CFG.hidden_size), jnp.float32)
    ref = _moe(laid_out, x, form)
    perm = np.random.default_rng(0).permutation(16)
    np.testing.assert_array_equal(_moe(laid_out, x[:, perm], form), ref[:, perm])
    dirty = x.at[:, 1::2].set(jnp.nan)
    got = _moe(laid_out, dirty, form)
    np.testing.assert_array_equal(got[:, ::2], ref[:, ::2])
    assert np.isnan(got[:, 1::2]).all()


def test_pairs_of_many_rows_are_each_row_alone_bit_for_bit(laid_out):
    """The `pairs` loop runs its pairs in expert order (an expert several rows select is read from
    memory once), yet each row adds its experts in expert order, as a row alone does: the same
    bytes. Four slots a row, so that the order of a row's sum shows in its bytes."""
    rng = np.random.default_rng(3)
    rows, k = 6, 4
    top_i = jnp.asarray(np.sort([rng.choice(CFG.num_experts, k, replace=False) for _ in range(rows)], axis=-1))
    top_w = jnp.asarray(rng.uniform(size=(rows, k)), jnp.float32)
    x = jax.random.normal(jax.random.key(7), (rows, CFG.hidden_size), jnp.float32)
    run = jax.jit(lambda x, i, w, gu, d: mlp._pairs(x, i, w, gu, d, CFG.moe_intermediate_size))
    many = np.asarray(run(x, top_i, top_w, laid_out["gate_up"], laid_out["down"]))
    for r in range(rows):
        alone = run(x[r : r + 1], top_i[r : r + 1], top_w[r : r + 1], laid_out["gate_up"], laid_out["down"])
        np.testing.assert_array_equal(many[r], np.asarray(alone)[0])


def test_form_follows_the_row_count():
    """At qwen3-next-h512's widths: pairs while rows x top_k <= E (LEAVES_PAIRS_PER_EXPERT x E over
    expert leaves, and the stacked rule beyond), grouped from GROUPED_MIN_PAIRS_PER_EXPERT pairs per
    expert (or with more than DENSE_MAX_EXPERTS experts), dense in between; dense whenever every
    expert on every row is small (the tiny preset's decode and verify steps). The grouped capacity
    covers the average load."""
    wide = config("qwen3-next-h512")
    e, k = wide.num_experts, wide.num_experts_per_tok
    first_grouped = mlp.GROUPED_MIN_PAIRS_PER_EXPERT * e // k
    rows = (1, e // k, e // k + 1, first_grouped - 1, first_grouped)
    assert [mlp.moe_form(r, wide) for r in rows] == ["pairs", "pairs", "dense", "dense", "grouped"]
    most_pairs = mlp.LEAVES_PAIRS_PER_EXPERT * e // k  # over expert leaves
    assert [mlp.moe_form(r, wide, expert_leaves=True) for r in (1, most_pairs)] == ["pairs", "pairs"]
    beyond = (most_pairs + 1, 2 * most_pairs)  # the stacked rule again
    assert [mlp.moe_form(r, wide, expert_leaves=True) for r in beyond] == [mlp.moe_form(r, wide) for r in beyond]
    many = wide.replace(num_experts=4 * mlp.DENSE_MAX_EXPERTS)
    assert [mlp.moe_form(r, many) for r in (many.num_experts // k, many.num_experts // k + 1)] == ["pairs", "grouped"]
    per_row = CFG.num_experts * 3 * CFG.moe_intermediate_size * CFG.hidden_size
    small = mlp.DENSE_MAX_MACS // per_row
    assert [mlp.moe_form(r, CFG) for r in (1, small, small + 1)] == ["dense", "dense", "grouped"]
    assert mlp.grouped_capacity(1024, wide) % 8 == 0 and mlp.grouped_capacity(1024, wide) > 1024 * k // e


@pytest.mark.parametrize(("experts", "k"), [(8, 2), (32, 4), (512, 10)])
def test_the_router_top_k_is_lax_top_k(experts, k):
    """`mlp.top_k` (a stable sort) returns `lax.top_k`'s values and indices bit for bit: ties (the lower
    index first), rows of equal zeros, a NaN row, batch axes."""
    rng = np.random.default_rng(experts)
    probs = jax.nn.softmax(jnp.asarray(rng.standard_normal((3, 6, experts)), jnp.float32), axis=-1)
    probs = probs.at[0, 0, 1:4].set(probs[0, 0, 5]).at[0, 1].set(0.0).at[1, 2].set(jnp.nan)
    want = jax.lax.top_k(probs, k)
    got = jax.jit(mlp.top_k, static_argnums=1)(probs, k)
    assert got[1].dtype == want[1].dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
