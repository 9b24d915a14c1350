"""The two layouts of the layer stack: the scan layout of repeated layer groups computes what the
list layout (the engine's default) computes."""

import jax
import numpy as np
import pytest
from conftest import settings

from metrale_jax.config import FULL, LINEAR
from metrale_jax.engine.engine import Engine
from metrale_jax.errors import MetraleError
from metrale_jax.model.cache import prefill_and_decode
from metrale_jax.model.layer_groups import arrange_layers, layer_period, stack_layer_groups
from metrale_jax.model_registry import TINY
from metrale_jax.params import init_params

PERIODIC = TINY.replace(num_hidden_layers=8, layer_types=(LINEAR, LINEAR, LINEAR, FULL) * 2, mlp_only_layers=())


def test_layer_period():
    assert layer_period(PERIODIC) == 4
    assert layer_period(TINY) == 4  # layer 1 is dense (mlp_only_layers): no repetition in 4 layers
    assert layer_period(TINY.replace(mlp_only_layers=())) == 2
    assert layer_period(PERIODIC.replace(mlp_only_layers=(6,))) == 8


def test_stacked_params_have_a_group_axis():
    params = init_params(PERIODIC, 0)
    stacked = stack_layer_groups(params, PERIODIC)
    assert "layers" not in stacked and len(stacked["layer_groups"]) == 4
    np.testing.assert_array_equal(stacked["layer_groups"][3]["attn"]["w_in"][1], params["layers"][7]["attn"]["w_in"])
    tiny = init_params(TINY, 0)
    assert stack_layer_groups(tiny, TINY) is tiny  # no repetition: the list layout stays
    assert sum(x.size for x in jax.tree_util.tree_leaves(stacked)) == sum(
        x.size for x in jax.tree_util.tree_leaves(params)
    )


def test_arrange_layers_names_the_layouts():
    params = init_params(PERIODIC, 0)
    assert arrange_layers(params, PERIODIC, "list") is params
    assert "layer_groups" in arrange_layers(params, PERIODIC, "scan")
    with pytest.raises(MetraleError, match="unknown layout 'stacked' \\(choose from list, scan\\)"):
        arrange_layers(params, PERIODIC, "stacked")


@pytest.mark.parametrize("layout", ["list", "scan"])
def test_engine_layouts_match_the_cached_forward(layout):
    params = init_params(PERIODIC, 1)
    prompt = [int(x) for x in np.random.default_rng(0).integers(0, 256, size=40)]
    ref, fed = prefill_and_decode(params, PERIODIC, prompt, 6)
    eng = Engine(PERIODIC, params, settings(max_batch_size=2, max_seq_len=128, max_prefill_tokens=32), layout=layout)
    assert ("layer_groups" in eng.params) == (layout == "scan")
    seq = eng.alloc_sequence()
    rows = [eng.prefill(seq, prompt)] + [eng.decode(seq, t) for t in fed]
    ref = np.asarray(ref)[len(prompt) - 1 :]
    np.testing.assert_allclose(np.stack(rows), ref, atol=2e-5 * np.abs(ref).max())
