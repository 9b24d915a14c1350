"""FP8 block-scaled weights under tensor / expert parallelism (`engine.sharding`): a leaf's values,
block scales and kept rows shard together where every shard boundary falls between scale blocks;
where one would cut a block, one `error:` line names the tensor (exit 2), before any compile.

Contract of the sharded runs (`tests/fp8_sharded_worker.py`, 4 forced host devices, float32):
on the FP8 fixtures re-blocked to 4x4 scale blocks (the fixtures' e4m3 values and scales exactly,
`fp8_fixtures.reblocked`), every call of `sharded_check.scenario` at tp 2 (and, on the MoE
fixture, ep 2 and tp 2 x ep 2) has max |logit - one device's FP8 logit| <= `LOGITS_ATOL` (1e-4:
each device dequantises the same blocks to the same f32 values; only the partitioned products'
all-reduce sums in another order, as for unquantised weights in tests/test_sharding.py) and
every argmax equal; greedy speculative == greedy at tp 2 on the MoE fixture (composed and fused);
the planner plans that mesh on the same FP8 leaves.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from fp8_fixtures import FP8_FIXTURES, fixture_dir, reblocked
from test_sharding import _worker_json

from metrale_jax.checkpoint import load_checkpoint
from metrale_jax.engine.sharding import MeshError, check_fp8_blocks
from metrale_jax.sharded_check import LOGITS_ATOL
from metrale_jax_cli.memory_cmd import memory


@pytest.fixture(scope="module")
def worker() -> dict:
    return _worker_json("fp8_sharded_worker.py", 1500)


@pytest.mark.parametrize("name", FP8_FIXTURES)
def test_fp8_logits_under_a_mesh_match_one_device(worker, name):
    runs = worker["logits"][name]
    assert set(runs) >= {"1x1", "2x1"}
    for mesh, calls in runs.items():
        assert len(calls) == 5
        for n, c in enumerate(calls):
            assert c["max_abs"] <= LOGITS_ATOL and c["argmax_equal"], (mesh, n, c)
    assert all(c["max_abs"] == 0.0 for c in runs["1x1"])


def test_fp8_speculative_equals_greedy_at_tp2(worker):
    """Tokens only: this fixture's tp 2 decode and propose programs copy a pool leaf each, FP8 or not
    (the unquantised `qwen3_next_moe` fixture measured the same 2 copies)."""
    spec = worker["speculative"]["2x1"]
    assert spec["composed"] and spec["fused"], spec


def test_generate_refuses_a_mesh_that_cuts_a_scale_block_in_one_line(worker):
    r = worker["refusal"]
    assert r["exit_code"] == 2, r
    lines = r["output"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: FP8 tensor model.language_model.layers."), lines
    assert "--tensor-parallel-size 2 cuts its" in lines[0]


def test_the_planner_compiles_a_mesh_on_the_loaders_fp8_leaves(worker):
    """At tp 2 the planner's step programs hold the FP8 leaves the loader holds (their in-product
    dequantisation is in the activation figures), not full-precision weights."""
    plan = worker["planned"]
    assert plan["program_fp8_leaves"] == plan["loaded_fp8_leaves"] > 0, plan


def test_the_block_check_names_the_tensor_whose_block_a_shard_cuts(tmp_path):
    cfg, params = load_checkpoint(fixture_dir("qwen3_5_dense_fp8"))
    check_fp8_blocks(params, cfg, 1)
    with pytest.raises(MeshError) as e:
        check_fp8_blocks(params, cfg, 2)
    msg = str(e.value)
    assert msg.startswith("FP8 tensor model.language_model.layers.0.linear_attn.in_proj_qkv.weight:")
    assert "a part of 16 rows split 2 ways is 8 rows a device, not whole 16-row blocks" in msg
    cfg, params = load_checkpoint(fixture_dir("qwen3_next_moe_fp8"))
    with pytest.raises(MeshError, match=r"out_proj.weight: .*its 48 columns split 2 ways are 24 a device"):
        check_fp8_blocks(params, cfg, 2)
    cfg, params = load_checkpoint(reblocked("qwen3_next_moe_fp8", str(tmp_path / "moe"), 4))
    check_fp8_blocks(params, cfg, 2)
    with pytest.raises(MeshError, match=r"shared_expert.gate_proj.weight: .* 24 rows split 4 ways is 6 rows"):
        check_fp8_blocks(params, cfg, 4)


def _memory(*argv: str):
    args = ["--device", "H200", "--no-activations", "--json", "--isl", "4096", "--osl", "1024"]
    return CliRunner().invoke(memory, [*args, *argv])


def test_the_planner_refuses_an_fp8_mesh_that_cuts_a_block_and_plans_the_80b_at_tp2():
    r = _memory(
        "--checkpoint", fixture_dir("qwen3_5_dense_fp8"), "--concurrency", "2", "--", "--tensor-parallel-size", "2"
    )
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert r.output.startswith("error: FP8 tensor model.language_model.layers."), r.output
    argv = ["--checkpoint", "Qwen/Qwen3-Next-80B-A3B-Instruct-FP8", "--recipe", "qwen3-next/qwen3-next-80b-a3b-fp8-mtp"]
    one, two = (_memory(*argv, "--concurrency", "8", "--", "--tensor-parallel-size", tp) for tp in ("1", "2"))
    assert one.exit_code == two.exit_code == 0, (one.output, two.output)
    w1, w2 = (sum(row["bytes"] for row in json.loads(r.stdout)["weights"]) for r in (one, two))
    assert json.loads(two.stdout)["totals"]["fits"] and 0.5 < w2 / w1 < 0.55
