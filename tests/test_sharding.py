"""Tensor and expert parallelism (`metrale_jax.engine.sharding`): the layout table, the mesh flags'
validation, and the sharded engine on 8 forced host devices.

The sharded scenarios run in a process of their own (`tests/sharded_worker.py`: the device count
is fixed when jax starts, and this process has one device). Their contract against the
single-device engine (tp 1 x ep 1), float32 tiny models:
- logits of prefill, batched decode, ragged verify (K = 4/2) and a decode after the verdict, at
  tp 1, 2, 4, ep 2 and tp 2 x ep 2: max |delta| <= `LOGITS_ATOL` and every argmax equal (the
  partitioned products and their all-reduces sum in another order; measured max |delta|
  1.9e-5 at tp 4, logits of magnitude ~10);
- greedy speculative generation (composed and fused steps) emits plain greedy's tokens at tp 2
  and tp 2 x ep 2, and no program copies a whole pool leaf;
- NaN in every slot, block, verify row and stash row a sequence does not own changes none of
  its outputs, sharded (test_engine's scenario);
- planned == allocated: each pool buffer's and weight leaf's bytes on every device are the
  planner's per-device figures.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from metrale_jax.engine import sharding
from metrale_jax.engine.pool import POOL_LABELS
from metrale_jax.model_registry import TINY
from metrale_jax_cli.main import cli

LOGITS_ATOL = 1e-4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker_json(script: str, timeout: int) -> dict:
    """Run `tests/<script>` in a process of its own and return the JSON object on its last line."""
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def worker() -> dict:
    return _worker_json("sharded_worker.py", 1200)


@pytest.mark.parametrize("mesh", ["2x1", "4x1", "1x2", "2x2"])
def test_sharded_logits_agree_with_one_device(worker, mesh):
    calls = worker["logits"][mesh]
    assert len(calls) == 5
    for n, c in enumerate(calls):
        assert c["max_abs"] <= LOGITS_ATOL and c["argmax_equal"], (mesh, n, c)
    assert all(c["max_abs"] == 0.0 for c in worker["logits"]["1x1"])


@pytest.mark.parametrize("mesh", ["2x1", "2x2"])
def test_sharded_speculative_equals_greedy_in_place(worker, mesh):
    assert worker["speculative"][mesh] == {"composed": True, "fused": True, "pool_copies": 0}


@pytest.mark.parametrize("mesh", ["2x1", "2x2"])
def test_sharded_nan_isolation(worker, mesh):
    assert worker["nan_isolation"][mesh] == {"composed": True, "fused": True}


@pytest.mark.parametrize("mesh", ["2x1", "2x2"])
def test_planned_equals_allocated_per_buffer_and_device(worker, mesh):
    """Every pool buffer's bytes on each device are the planner's term, every weight leaf's the
    planner's share of it."""
    assert worker["planned"][mesh]["compared"] > 60
    assert worker["planned"][mesh]["mismatches"] == []


def test_the_diff_passes_its_tp2_variant(tmp_path):
    """`metrale-jax diff --verify-batch 2,4 --verify-batch-ks 2,4 --mtp --forwards xla-repeat,tp2` on
    tiny, 2 forced host devices: PASS, the tp2 variant within its declared bound on every shape."""
    out = tmp_path / "diff.json"
    argv = ["--checkpoint", "tiny", "--steps", "4", "--verify-batch", "2,4", "--verify-batch-ks", "2,4", "--mtp"]
    argv += ["--speculative", "--num-drafts", "3", "--forwards", "xla-repeat,tp2", "--out", str(out)]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    code = "import sys; from metrale_jax_cli.main import cli; cli(['diff', *sys.argv[1:]])"
    r = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["verdict"] == "PASS", report["reasons"]
    tp2 = [c for shape in report["shapes"] for c in shape["comparisons"] if c["variant"] == "tp2"]
    assert len(tp2) == 6 and all(c["ok"] for c in tp2)


def test_the_pallas_kernels_run_on_each_devices_heads():
    """Under a tp 2 mesh the `pallas` forward's GDN (chunked and row by row) and paged-attention
    kernels (interpreted) run in a shard_map on each device's heads, byte-equal to one device, their
    outputs left split over the heads; the engine on that forward at tp 2 agrees with tp 1 within the
    sharded contract (`tests/sharded_kernels_worker.py`)."""
    out = _worker_json("sharded_kernels_worker.py", 600)
    assert out.pop("refusals") == []
    engine = out.pop("engine")
    assert len(engine) == 5 and all(c["max_abs"] <= LOGITS_ATOL and c["argmax_equal"] for c in engine), engine
    assert out == {
        op: {"equal": True, "sharded": True, "shard_map": True} for op in ("gdn_chunk", "gdn_rows", "attention")
    }


def test_the_layout_table_names_every_pool_leaf():
    assert set(sharding.POOL_LAYOUT) == set(POOL_LABELS)


def test_the_lm_head_splits_by_vocabulary_rows_and_the_embedding_stays_whole():
    div = sharding.param_divisors(TINY, 2, 2)
    assert (div[("lm_head",)], div[("embed",)]) == (2, 1)
    odd = dataclasses.replace(TINY, vocab_size=251)
    sharding.check_mesh(dataclasses.replace(odd, tie_word_embeddings=True), 2, 1, 8)  # tied: stays whole
    with pytest.raises(sharding.MeshError, match="2 does not divide the model's 251 vocabulary entries"):
        sharding.check_mesh(odd, 2, 1, 8)


def test_the_shared_expert_splits_over_tp_and_the_router_stays_whole():
    """A MoE layer's shared expert is split like the dense MLP (gate/up rows, down columns) over tp,
    its router rows (with the shared-expert gate) are whole on every device, its experts over all."""
    div = sharding.param_divisors(TINY, 2, 2)
    moe = next(i for i in range(TINY.num_hidden_layers) if TINY.is_moe_layer(i))
    got = {k: div[("layers", moe, "mlp", k)] for k in ("router", "shared_gate_up", "shared_down", "gate_up")}
    assert got == {"router": 1, "shared_gate_up": 2, "shared_down": 2, "gate_up": 4}
    assert div[("mtp", "layers", 0, "mlp", "shared_gate_up")] == 2
    odd = dataclasses.replace(TINY, shared_expert_intermediate_size=31)
    with pytest.raises(sharding.MeshError, match="2 does not divide the model's 31 shared-expert intermediate size"):
        sharding.check_mesh(odd, 2, 1, 8)


def test_group_major_order_is_a_permutation_per_group():
    """Group g of the group-major order holds the g-th tp-th of every part, in part order."""
    parts, tp = (4, 4, 8), 2
    index = sharding._group_major_index(parts, tp)
    assert sorted(index.tolist()) == list(range(16))
    assert index.tolist() == [0, 1, 4, 5, 8, 9, 10, 11, 2, 3, 6, 7, 12, 13, 14, 15]
    x = np.arange(16 * 3).reshape(16, 3)
    y = sharding._regroup(x, 0, parts, tp, inverse=False)
    np.testing.assert_array_equal(sharding._regroup(y, 0, parts, tp, inverse=True), x)


@pytest.mark.parametrize(
    ("tp", "ep", "devices", "needle"),
    [
        (3, 1, 8, "does not divide the model's 2 attention KV heads"),
        (1, 3, 8, "do not divide the model's 8 experts"),
        (2, 2, 2, "needs more than the 2 present"),
        (0, 1, 8, "must be >= 1"),
    ],
)
def test_check_mesh_refuses_with_one_line(tp, ep, devices, needle):
    with pytest.raises(sharding.MeshError, match=needle) as e:
        sharding.check_mesh(TINY, tp, ep, devices)
    assert len(e.value.messages) == 1


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--tensor-parallel-size", "3"], "--tensor-parallel-size 3 does not divide"),
        (["--tensor-parallel-size", "2"], "needs more than the 1 present"),
        (["--expert-parallel-size", "0"], "--expert-parallel-size must be >= 1"),
    ],
)
def test_bad_mesh_flags_are_one_error_line_exit_2(flags, needle):
    argv = ["generate", "--checkpoint", "tiny", "--prompt", "hi", "--max-new-tokens", "1", *flags]
    r = CliRunner().invoke(cli, argv)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], r.stderr
