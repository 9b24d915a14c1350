"""Config translation from HF config.json: defaults, layer patterns, wrappers, errors."""

import json

import pytest

from metrale_jax.config import FULL, LINEAR, ConfigError, from_hf_dict, load_model_config
from metrale_jax.model_registry import TINY


def _next(**kw):
    d = {
        "model_type": "qwen3_next",
        "vocab_size": 100,
        "hidden_size": 32,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    }
    d.update(kw)
    return d


def test_layer_types_from_interval_and_hf_defaults():
    cfg = from_hf_dict(_next())
    assert cfg.layer_types == (LINEAR, LINEAR, LINEAR, FULL) * 2
    assert cfg.full_layer_ids == (3, 7)
    assert cfg.rope_theta == 10000.0 and cfg.partial_rotary_factor == 0.25
    assert cfg.moe_intermediate_size == 512 and cfg.norm_topk_prob
    assert cfg.rotary_dim == 4 and cfg.conv_dim == 2 * 16 + 32
    cfg2 = from_hf_dict(_next(full_attention_interval=2))
    assert cfg2.layer_types == (LINEAR, FULL) * 4


def test_rope_parameters_and_legacy_keys():
    a = from_hf_dict(_next(rope_theta=1e7, partial_rotary_factor=0.5))
    b = from_hf_dict(_next(rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.5}))
    assert a.rope_theta == b.rope_theta == 1e7 and a.rotary_dim == b.rotary_dim == 8


def test_dense_moe_rules():
    cfg = from_hf_dict(_next(mlp_only_layers=[1], decoder_sparse_step=2))
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, False, False, True]
    dense = from_hf_dict(_next(num_experts=0))
    assert not any(dense.is_moe_layer(i) for i in range(8))


def test_qwen35_wrapper_and_moe_text():
    wrapped = {"model_type": "qwen3_5", "text_config": _next(model_type="qwen3_5_text"), "tie_word_embeddings": True}
    cfg = from_hf_dict(wrapped)
    assert cfg.model_type == "qwen3_5_text" and cfg.num_experts == 0 and cfg.tie_word_embeddings
    assert cfg.trunk_prefix == "model.language_model" and cfg.weight_layout == "qwen3_5"
    moe = from_hf_dict(_next(model_type="qwen3_5_moe_text", norm_topk_prob=False, mtp_num_hidden_layers=1))
    assert moe.num_experts == 4 and moe.norm_topk_prob and moe.num_mtp_layers == 1


def test_hashable_and_round_trip():
    assert hash(TINY) == hash(from_hf_dict(TINY.to_hf_dict()))
    assert from_hf_dict(TINY.to_hf_dict()) == TINY
    q35 = TINY.replace(
        model_type="qwen3_5_moe_text", trunk_prefix="model.language_model", weight_layout="qwen3_5", mlp_only_layers=()
    )
    assert from_hf_dict(json.loads(json.dumps(q35.to_hf_dict()))) == q35


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"model_type": "llama"}, "unsupported model_type 'llama'"),
        (
            {"model_type": "qwen3_next", "vocab_size": 1},
            "lacks required field(s): hidden_size, num_hidden_layers, num_attention_heads",
        ),
        ({"model_type": "qwen3_5"}, "has no text_config"),
        (_next(layer_types=["linear_attention"]), "layer_types has 1 entries for 8 layers"),
        (_next(num_key_value_heads=3), "not a multiple of num_key_value_heads"),
    ],
)
def test_errors_name_the_problem(raw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        from_hf_dict(raw)


def test_load_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model_config(tmp_path)


def test_every_type_problem_is_listed_in_one_error():
    with pytest.raises(ConfigError) as e:
        from_hf_dict(_next(vocab_size=100.5, head_dim="16", attention_bias="no", rms_norm_eps=float("nan")))
    assert str(e.value).startswith("config.json (4 problem(s)): vocab_size must be an integer, got 100.5; ")
    for needle in ("head_dim must be an integer", "attention_bias must be true or false", "rms_norm_eps must be a"):
        assert needle in str(e.value)


def test_every_range_problem_is_listed_in_one_error():
    with pytest.raises(ConfigError) as e:
        from_hf_dict(_next(hidden_size=-64, num_key_value_heads=0, num_experts=-1))
    assert str(e.value).count(";") == 2 and "hidden_size must be a positive integer, got -64" in str(e.value)
    with pytest.raises(ConfigError, match=r"num_hidden_layers 1000000000 is over 4096"):
        from_hf_dict(_next(num_hidden_layers=10**9))


def test_an_odd_rotary_dim_rotates_one_channel_more_as_hf_does():
    cfg = from_hf_dict(_next(head_dim=20, partial_rotary_factor=0.25))
    assert (cfg.rotary_dim, cfg.rotary_width) == (5, 6)
    with pytest.raises(ConfigError, match="rotary dim 5 rotates 6 channels, over head_dim 5"):
        from_hf_dict(_next(head_dim=5, partial_rotary_factor=1.0))
