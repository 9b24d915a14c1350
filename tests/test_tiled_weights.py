"""The tiled weight layout (`metrale_jax.model.linear`): the same values as the [out, in] weight,
products equal to float64 within float32 rounding at every row count and form, padding past
`out` never read into an output, rows isolated (NaN included), and the single-device CPU engine
holding its projections tiled and handing them back in checkpoint order when it is resharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.models import model, settings
from metrale_jax.engine.engine import Engine
from metrale_jax.model import linear as lin

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("shape", [(64, 32), (100, 48), (3, 128, 16), (2, 4, 192, 8)])
def test_tiling_round_trips_and_pads_with_zeros(shape):
    w = jnp.asarray(RNG.standard_normal(shape), jnp.float32)
    t = lin.tile_weight(w)
    assert t.shape == shape and t.dtype == w.dtype
    assert t.tiles.shape == (*shape[:-2], -(-shape[-2] // lin.TILE), shape[-1], lin.TILE)
    np.testing.assert_array_equal(lin.untile_weight(t), w)
    flat = np.swapaxes(np.asarray(t.tiles), -1, -2).reshape(*shape[:-2], -1, shape[-1])
    assert not flat[..., shape[-2] :, :].any()


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 33, lin.TILED_BATCHED_MAX_ROWS, lin.TILED_BATCHED_MAX_ROWS + 1, 200])
@pytest.mark.parametrize("out", [64, 150])
def test_a_tiled_product_is_the_product(rows, out):
    """Both forms (batched over the tiles, one contraction) against float64, lead axes kept."""
    x = jnp.asarray(RNG.standard_normal((1, rows, 96)), jnp.float32)
    w = jnp.asarray(RNG.standard_normal((out, 96)), jnp.float32)
    got = np.asarray(jax.jit(lin.linear)(x, lin.tile_weight(w)))
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    assert got.shape == (1, rows, out)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("rows", [3, lin.TILED_BATCHED_MAX_ROWS + 3])
def test_per_expert_products_and_merged_experts_are_the_products(rows):
    x = jnp.asarray(RNG.standard_normal((4, rows, 32)), jnp.float32)
    w = jnp.asarray(RNG.standard_normal((4, 128, 32)), jnp.float32)
    t = lin.tile_weight(w)
    ref = np.einsum("eci,eoi->eco", np.asarray(x, np.float64), np.asarray(w, np.float64))
    tol = 1e-5 * np.abs(ref).max()
    np.testing.assert_allclose(jax.jit(lin.linear_per_expert)(x, t), ref, rtol=0, atol=tol)
    merged = jax.jit(lambda x, t: lin.linear(x, lin.merge_experts(t)))(x[0], t)
    np.testing.assert_allclose(
        merged, np.asarray(x[0], np.float64) @ np.asarray(w, np.float64).reshape(-1, 32).T, atol=tol
    )
    one = jax.jit(lambda x, t, e: lin.linear(x, lin.expert_weight(t, e)))(x[2], t, 2)
    np.testing.assert_allclose(one, ref[2], rtol=0, atol=tol)


@pytest.mark.parametrize("rows", [6, lin.TILED_BATCHED_MAX_ROWS + 6])
def test_tiled_rows_are_isolated_nan_included(rows):
    w = lin.tile_weight(jnp.asarray(RNG.standard_normal((130, 40)), jnp.float32))
    x = jnp.asarray(RNG.standard_normal((rows, 40)), jnp.float32)
    f = jax.jit(lin.linear)
    ref = np.asarray(f(x, w))
    got = np.asarray(f(x.at[1::2].set(jnp.nan), w))
    np.testing.assert_array_equal(got[::2], ref[::2])
    assert np.isnan(got[1::2]).all()


def test_the_cpu_engine_tiles_its_projections_and_reshards_them_in_checkpoint_order():
    cfg, params = model("tiny")
    eng = Engine(cfg, params, settings(max_batch_size=2, max_seq_len=64, speculative=True, num_drafts=2))
    assert lin.tiled_layout_applies(None)
    tiled = {
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_flatten_with_path(
            eng.params, is_leaf=lambda x: isinstance(x, lin.TiledWeight)
        )[0]
        if isinstance(leaf, lin.TiledWeight)
    }
    expected = {
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
        if path[-1].key in lin.TILED_LEAVES
        and leaf.shape[-2] >= lin.TILE
        and (leaf.ndim == 2 or leaf.shape[-2] % lin.TILE == 0)
    }
    assert tiled == expected and any("lm_head" in k for k in tiled) and any("gate_up" in k for k in tiled)
    back = lin.untile_weights(eng.params)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(a, b)
