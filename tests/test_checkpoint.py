"""Safetensors checkpoints: round trips in both layouts, sharding, lazy bf16, and every error."""

import json
import os
import re
import struct

import jax
import numpy as np
import pytest
import safetensors.numpy

from metrale_jax.checkpoint import (
    CheckpointError,
    bindings,
    index_checkpoint,
    load_checkpoint,
    read_header,
    save_checkpoint,
    write_safetensors,
)
from metrale_jax.model_registry import TINY
from metrale_jax.params import init_params, is_spec, param_specs

Q35 = TINY.replace(
    model_type="qwen3_5_moe_text", trunk_prefix="model.language_model", weight_layout="qwen3_5", mlp_only_layers=()
)


def _equal_trees(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("cfg", [TINY, Q35], ids=["qwen3_next", "qwen3_5_moe"])
def test_round_trip(tmp_path, cfg):
    params = init_params(cfg, 3)
    save_checkpoint(tmp_path, cfg, params)
    cfg2, params2 = load_checkpoint(str(tmp_path))
    assert cfg2 == cfg
    _equal_trees(params, params2)


def test_layout_names(tmp_path):
    save_checkpoint(tmp_path, TINY, init_params(TINY, 0))
    names = set(read_header(str(tmp_path / "model.safetensors")))
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in names
    assert "model.layers.0.linear_attn.in_proj_ba.weight" in names
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names
    assert "mtp.layers.0.self_attn.q_proj.weight" in names and "mtp.pre_fc_norm_hidden.weight" in names
    q = tmp_path / "q35"
    save_checkpoint(q, Q35, init_params(Q35, 0))
    names = set(read_header(str(q / "model.safetensors")))
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in names
    assert "model.language_model.layers.1.mlp.experts.gate_up_proj" in names
    assert json.loads((q / "config.json").read_text())["model_type"] == "qwen3_5_moe"


def test_interleaved_qkvz_matches_hf_grouping(tmp_path):
    """Qwen3-Next groups [q_g | k_g | v_g | z_g] per key head: check one row of each part."""
    params = init_params(TINY, 1)
    save_checkpoint(tmp_path, TINY, params)
    ref = read_header(str(tmp_path / "model.safetensors"))["model.layers.0.linear_attn.in_proj_qkvz.weight"].read()
    w_in = np.asarray(params["layers"][0]["gdn"]["w_in"])
    w_qkv, w_z = w_in[: TINY.conv_dim], w_in[TINY.conv_dim : TINY.conv_dim + TINY.value_dim]
    dk, dv, r = TINY.linear_key_head_dim, TINY.linear_value_head_dim, 2
    group = 2 * dk + 2 * r * dv
    # key head 1: q rows dk..2dk of w_qkv, k rows key_dim+dk.., v rows of value heads 2,3, z likewise
    np.testing.assert_array_equal(ref[group : group + dk], w_qkv[dk : 2 * dk])
    np.testing.assert_array_equal(ref[group + dk : group + 2 * dk], w_qkv[TINY.key_dim + dk : TINY.key_dim + 2 * dk])
    v0 = 2 * TINY.key_dim + r * dv
    np.testing.assert_array_equal(ref[group + 2 * dk : group + 2 * dk + r * dv], w_qkv[v0 : v0 + r * dv])
    np.testing.assert_array_equal(ref[group + 2 * dk + r * dv : 2 * group], w_z[r * dv : 2 * r * dv])


def test_sharded_bf16_lazy(tmp_path):
    params = init_params(TINY, 2, dtype=jax.numpy.bfloat16)
    save_checkpoint(tmp_path, TINY, params)
    refs = read_header(str(tmp_path / "model.safetensors"))
    tensors = {n: np.array(r.read()) for n, r in refs.items()}
    os.remove(tmp_path / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, ns in shards.items():
        write_safetensors(str(tmp_path / shard), {n: tensors[n] for n in ns})
        weight_map.update({n: shard for n in ns})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert all(isinstance(r.read(), np.memmap) for r in index_checkpoint(str(tmp_path)).values())
    cfg, loaded = load_checkpoint(str(tmp_path))
    _equal_trees(params, loaded)
    _, as_f32 = load_checkpoint(str(tmp_path), np.float32)
    assert jax.tree_util.tree_leaves(as_f32)[0].dtype == np.float32


def test_files_readable_by_safetensors_library(tmp_path):
    a = {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "y": np.ones(3, np.int64)}
    write_safetensors(str(tmp_path / "t.safetensors"), a)
    back = safetensors.numpy.load_file(str(tmp_path / "t.safetensors"))
    np.testing.assert_array_equal(back["x"], a["x"])
    safetensors.numpy.save_file(a, str(tmp_path / "u.safetensors"))
    np.testing.assert_array_equal(read_header(str(tmp_path / "u.safetensors"))["x"].read(), a["x"])


def _two_tensors(tmp_path, edit):
    """A file of x [2, 3] f32 and y [3] f32 whose header `edit` changed (data bytes unchanged)."""
    path = tmp_path / "t.safetensors"
    write_safetensors(str(path), {"x": np.zeros((2, 3), np.float32), "y": np.ones(3, np.float32)})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n :])
    return str(path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda h: h["y"].update(data_offsets=[-12, 0]), "data_offsets [-12, 0] are not two non-negative integers"),
        (lambda h: h["y"].update(data_offsets=[12, 24]), "tensors 'x' and 'y' overlap"),
        (lambda h: h["y"].update(data_offsets=[36, 48]), "are not within the 36-byte data section"),
        (lambda h: h["y"].update(shape=[2]), "hold 12 bytes; shape [2] of F32 needs 8"),
        (lambda h: h["y"].update(shape=["3"]), "shape ['3'] is not a list of non-negative integers"),
    ],
    ids=["negative", "overlap", "past-the-end", "size", "strings"],
)
def test_headers_the_safetensors_library_refuses_are_refused(tmp_path, edit, message):
    path = _two_tensors(tmp_path, edit)
    with pytest.raises(safetensors.SafetensorError):
        safetensors.numpy.load_file(path)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        read_header(path)


def _saved(tmp_path):
    save_checkpoint(tmp_path, TINY, init_params(TINY, 0))
    path = str(tmp_path / "model.safetensors")
    return path, {n: np.array(r.read()) for n, r in read_header(path).items()}


def test_missing_extra_shape_and_dtype_listed_together(tmp_path):
    path, t = _saved(tmp_path)
    del t["model.norm.weight"]
    t["model.layers.0.extra.weight"] = np.zeros(3, np.float32)
    t["lm_head.weight"] = np.zeros((5, 5), np.float32)
    t["mtp.fc.weight"] = t["mtp.fc.weight"].astype(np.int32)
    write_safetensors(path, t)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(str(tmp_path))
    msg = str(e.value)
    assert "4 problem(s)" in msg
    assert "missing tensor model.norm.weight" in msg
    assert "unexpected tensor model.layers.0.extra.weight" in msg
    assert "tensor lm_head.weight has shape [5, 5], expected [256, 64]" in msg
    assert "tensor mtp.fc.weight has dtype I32, expected a float dtype" in msg


def test_corrupt_header(tmp_path):
    path, _ = _saved(tmp_path)
    data = bytearray(open(path, "rb").read())
    data[8:20] = b"{{{{garbage!"
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        load_checkpoint(str(tmp_path))
    open(path, "wb").write(b"\xff" * 16)
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        load_checkpoint(str(tmp_path))


def test_index_naming_missing_shard(tmp_path):
    _saved(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00009-of-00009.safetensors"}})
    )
    with pytest.raises(CheckpointError, match="names missing shard.*model-00009-of-00009"):
        load_checkpoint(str(tmp_path))


def test_mtp_layer_count_inferred_from_checkpoint(tmp_path):
    """Qwen3-Next's release config has no MTP field: the checkpoint's mtp.* tensors decide."""
    save_checkpoint(tmp_path, TINY, init_params(TINY, 0))
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["num_nextn_predict_layers"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg, params = load_checkpoint(str(tmp_path))
    assert cfg.num_mtp_layers == 1 and "mtp" in params


def test_bindings_cover_every_leaf():
    for cfg in (TINY, Q35):
        leaves = len(jax.tree_util.tree_leaves(param_specs(cfg), is_leaf=is_spec))
        assert len({b.path for b in bindings(cfg)}) == len(bindings(cfg)) == leaves
