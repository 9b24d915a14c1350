"""FP8 block-scaled checkpoints (quant_method fp8): loading as shipped, parity with HF on the
dequantised weights, speculative ≡ greedy, and structural refusals in one line.

Fixtures `qwen3_5_dense_fp8` and `qwen3_next_moe_fp8` (scripts/make_hf_fixtures.py quantises the
f32 fixtures to e4m3 with bf16 `weight_scale_inv` per 32x32 block and records HF's logits on the
dequantised weights). Bound: the engine dequantises each block as f32(q) * f32(scale), the values
HF ran in f32, so the f32 logits keep the unquantised fixtures' bound (1e-4 of the largest logit).
"""

import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import FIXTURES, settings
from hf_golden import assert_bfloat16_tracks_hf, assert_float32_parity, golden, replayed_logits

from metrale_jax.checkpoint import CheckpointError, load_checkpoint, read_header, write_safetensors
from metrale_jax.engine.engine import Engine
from metrale_jax.engine.speculative import DraftSchedule, greedy_generate, speculative_generate
from metrale_jax.model.fp8_linear import Fp8BlockWeight
from metrale_jax.quantization import Quantization, scale_shape, tensor_bytes

NAMES = ["qwen3_5_dense_fp8", "qwen3_next_moe_fp8"]


def _dir(name):
    return os.path.join(FIXTURES, "hf", name)


@pytest.mark.parametrize("name", NAMES)
def test_fp8_logits_match_hf_on_the_dequantised_weights(name):
    g = golden(name)
    _, params, logits = replayed_logits(g, np.float32)
    leaves = [x for x in _walk(params) if isinstance(x, Fp8BlockWeight)]
    assert leaves and all(w.q.dtype == np.uint8 and w.dtype == ml_dtypes.float8_e4m3fn for w in leaves)
    assert_float32_parity(g, logits)


@pytest.mark.parametrize("name", NAMES)
def test_fp8_in_bfloat16_tracks_hfs_bfloat16_run(name):
    """Served in bf16 (the releases' dtype): HF's bf16 parity statistics (test_hf_parity)."""
    g = golden(name)
    assert_bfloat16_tracks_hf(g, replayed_logits(g, ml_dtypes.bfloat16)[2])


def _walk(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _walk(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from _walk(v)
    else:
        yield tree


def test_fp8_gdn_leaf_keeps_the_release_bf16_rows_as_its_tail():
    """Qwen3.5's w_in stacks qkv, z (FP8) then b, a (kept): the kept rows are the leaf's tail."""
    cfg, params = load_checkpoint(_dir("qwen3_5_dense_fp8"), np.float32)
    w = params["layers"][0]["gdn"]["w_in"]
    nv = cfg.linear_num_value_heads
    assert isinstance(w, Fp8BlockWeight) and w.tail is not None and w.tail.shape[0] == 2 * nv
    assert w.q.shape[0] == cfg.conv_dim + cfg.value_dim
    assert not isinstance(params["embed"], Fp8BlockWeight)


def _copy(tmp_path, name="qwen3_5_dense_fp8"):
    out = tmp_path / name
    shutil.copytree(_dir(name), out)
    return out


def _rewrite(path, edit):
    """Rewrite a safetensors file with `edit(tensors)` applied (numpy arrays, e4m3 included)."""
    refs = read_header(str(path))
    tensors = {n: np.array(r.read()) for n, r in refs.items()}
    edit(tensors)
    write_safetensors(str(path), tensors)


def test_scale_of_the_wrong_block_shape_is_one_clear_line(tmp_path):
    d = _copy(tmp_path)
    name = "model.language_model.layers.1.self_attn.o_proj.weight_scale_inv"
    _rewrite(d / "model.safetensors", lambda t: t.update({name: t[name][:1]}))
    with pytest.raises(CheckpointError, match=r"scale .*o_proj.weight_scale_inv has shape \[1, 2\], expected"):
        load_checkpoint(str(d))


def test_fp8_tensor_without_its_scale_is_refused(tmp_path):
    d = _copy(tmp_path)
    _rewrite(d / "model.safetensors", lambda t: t.pop("model.language_model.layers.0.mlp.down_proj.weight_scale_inv"))
    with pytest.raises(CheckpointError, match=r"FP8 tensor .*mlp.down_proj.weight has no scale"):
        load_checkpoint(str(d))


def _edit_config(d, edit):
    raw = json.loads((d / "config.json").read_text())
    edit(raw)
    (d / "config.json").write_text(json.dumps(raw))


def test_unsupported_quantization_method_is_one_line_naming_it(tmp_path):
    d = _copy(tmp_path)
    _edit_config(d, lambda r: r["quantization_config"].update(quant_method="awq"))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(str(d))
    assert str(e.value) == "quantization method 'awq' is not supported (supported: fp8; planner only: nvfp4)"


def test_fp8_tensors_without_a_quantization_config_are_one_line(tmp_path):
    d = _copy(tmp_path)
    _edit_config(d, lambda r: r.pop("quantization_config"))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(str(d))
    assert "problem(s)" not in str(e.value) and "declares no fp8 quantization_config" in str(e.value)


def test_fp8_bytes_count_values_and_block_scales():
    q = Quantization("fp8", (128, 128))
    assert scale_shape((512, 2048, 300), (128, 128)) == (512, 16, 3)
    assert tensor_bytes((1000, 300), 2, q, True) == 300_000 + 8 * 3 * 2
    assert tensor_bytes((1000, 300), 2, q, False) == 600_000
    assert tensor_bytes((64, 32), 2, Quantization("nvfp4", (1, 16)), True) == 1024 + 128 + 4


def test_speculative_equals_greedy_on_the_fp8_moe_fixture():
    """MTP speculation (FP8 drafter layer and experts) commits exactly the greedy tokens, in the
    checkpoint's own dtype, on both step paths."""
    cfg, params = load_checkpoint(_dir("qwen3_next_moe_fp8"))
    eng = Engine(cfg, params, settings(max_batch_size=2, max_seq_len=128, speculative=True, num_drafts=3))
    prompts = [[int(x) for x in np.random.default_rng(5).integers(0, cfg.vocab_size, size=n)] for n in (21, 9)]
    ref = greedy_generate(eng, prompts, 24)
    runs = [speculative_generate(eng, prompts, 24, DraftSchedule(3), fused=f) for f in (0, 1)]
    assert runs[0].tokens == runs[1].tokens == ref


def test_an_fp8_expert_stacks_pairs_form_dequantises_one_expert_at_a_time():
    """The MoE's per-pair loop over FP8 stacks (the form of a decode over many experts) holds one
    expert's dequantised weights, not the stacks: on XLA CPU an op on an e4m3 array other than its
    conversion runs in f16 after converting the whole operand, which the loop hoisted (the 80B
    FP8's decode planned 155 GB of temporaries); `Fp8BlockWeight.q` holds the values' bytes."""
    from metrale_jax.model import mlp
    from metrale_jax.model.fp8_linear import BITS_DTYPE

    e, inter, hidden, rows, k = 128, 256, 512, 8, 8
    sds = jax.ShapeDtypeStruct

    def stack(out, inp):
        return Fp8BlockWeight(sds((e, out, inp), BITS_DTYPE), sds((e, out // 128, inp // 128), jnp.bfloat16))

    args = (sds((rows, hidden), jnp.bfloat16), sds((rows, k), jnp.int32), sds((rows, k), jnp.bfloat16))
    run = jax.jit(lambda x, i, w, g, d: mlp._pairs(x, i, w, g, d, inter))
    temp = (
        run.lower(*args, stack(2 * inter, hidden), stack(hidden, inter)).compile().memory_analysis().temp_size_in_bytes
    )
    one_expert_bf16 = 3 * inter * hidden * 2
    assert temp < 4 * one_expert_bf16, (temp, e * one_expert_bf16)  # the stacks in bf16: 32x that


# ---- the planner ----


def _plan(checkpoint, recipe, c="8"):
    from click.testing import CliRunner

    from metrale_jax_cli.memory_cmd import memory

    argv = ["--checkpoint", checkpoint, "--recipe", recipe, "--device", "H200", "--no-activations", "--json"]
    run = CliRunner().invoke(memory, [*argv, "--isl", "4096", "--osl", "1024", "--concurrency", c])
    assert run.exit_code == 0, run.output
    return json.loads(run.output)


def _weights_mib(plan):
    return sum(row["bytes"] for row in plan["weights"]) / 2**20


def test_the_80b_fp8_recipe_fits_one_h200_where_the_bf16_one_does_not():
    fp8 = _plan("Qwen/Qwen3-Next-80B-A3B-Instruct-FP8", "qwen3-next/qwen3-next-80b-a3b-fp8-mtp")
    bf16 = _plan("Qwen/Qwen3-Next-80B-A3B-Instruct", "qwen3-next/qwen3-next-80b-a3b-mtp")
    assert fp8["totals"]["fits"] and not bf16["totals"]["fits"]
    # e4m3 values (1 byte) and a bf16 scale per 128x128 block where bf16 has 2 bytes a value
    assert 0.5 < _weights_mib(fp8) / _weights_mib(bf16) < 0.52
    assert fp8["inverse"]["max_concurrency"]["concurrency"] >= 8 and fp8["inverse"]["max_isl"]["isl"] > 4096


def test_nvfp4_weights_are_counted_from_modelopt_hf_quant_config():
    nvfp4 = _plan("nvidia/Qwen3.6-35B-A3B-NVFP4", "qwen3.6/qwen3.6-35b-a3b-nvfp4-mtp", "2")
    fp8 = _plan("Qwen/Qwen3.6-35B-A3B-FP8", "qwen3.6/qwen3.6-35b-a3b-fp8-mtp", "2")
    mlp4, mlp8 = (next(r for r in p["weights"] if r["group"] == "layers: mlp") for p in (nvfp4, fp8))
    assert "nvfp4" in mlp4["dtype"] and "fp8" in mlp8["dtype"]
    # half a byte a value and one e4m3 scale per 16 values, against one byte a value
    assert 0.5 < mlp4["bytes"] / mlp8["bytes"] < 0.6


def test_the_fp8_fixture_plan_counts_the_loaders_tensors_and_scales():
    from metrale_jax.memory.source import resolve_model
    from metrale_jax.memory.weights import weight_terms

    source = resolve_model(_dir("qwen3_5_dense_fp8"), Path("recipes"))
    planned = sum(t.bytes for t in weight_terms(source, np.float32))
    cfg, params = load_checkpoint(_dir("qwen3_5_dense_fp8"))
    leaves = list(_walk(params))
    held_values = sum(
        x.q.nbytes + (0 if x.tail is None else x.tail.nbytes) for x in leaves if isinstance(x, Fp8BlockWeight)
    )
    held_scales = sum(x.scale.nbytes for x in leaves if isinstance(x, Fp8BlockWeight))
    held_rest = sum(x.nbytes for x in leaves if not isinstance(x, Fp8BlockWeight))
    # Values and full-precision tensors: exactly the planned bytes. Scales: the file's blocks, plus
    # the rows the loader re-blocks where a stacked part starts inside a block (the fixture's 32-row
    # blocks over 80-row parts; the releases' parts are whole 128-row blocks, so none there).
    file_scales = sum(r.end - r.start for n, r in source.tensors.items() if n.endswith("_scale_inv"))
    assert held_values + held_rest + file_scales == planned
    assert file_scales <= held_scales <= 2 * file_scales


@pytest.mark.parametrize("name", NAMES)
def test_planned_step_programs_hold_the_fp8_leaves_the_loader_holds(name):
    """The planner compiles the step programs on abstract weights with the loader's FP8 leaves
    (values and kept rows of the same shapes and dtypes), so their in-product dequantisation is
    in the activation figures."""
    from metrale_jax.memory.activations import quantised_abstract
    from metrale_jax.memory.source import resolve_model
    from metrale_jax.params import init_params

    source = resolve_model(_dir(name), Path("recipes"))
    cfg, params = load_checkpoint(_dir(name))
    abstract = jax.eval_shape(lambda: init_params(source.config, 0, np.float32))
    planned = quantised_abstract(abstract, source.config, source.quantization)

    def parts(tree):
        return [
            (x.q.shape, x.q.dtype, None if x.tail is None else (x.tail.shape, x.tail.dtype))
            for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, Fp8BlockWeight))
            if isinstance(x, Fp8BlockWeight)
        ]

    assert parts(planned) == parts(params) and parts(params)
