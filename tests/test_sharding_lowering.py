"""The 80B's step programs lower for 8 H200s (tensor parallel 2 x expert parallel 4) on a CPU-only
machine: one layer group (3 GDN + 1 attention layer, full width: 512 experts, 16 GDN key heads, 2
KV heads) here (`metrale_jax.sharded_lowering`), every layer in `scripts/sharded_lowering.py`.

Claims: prefill, decode, verify, propose and the fused speculative step export for CUDA on the
abstract mesh with the engine's shardings (`engine.sharding`), each a program of 8 devices whose MoE
layers sum their routed experts over the devices (the shard_map's all-reduce; the partitioner adds
the heads' reductions when it compiles); with the `pallas` forward, every GDN and attention kernel is a
Triton call in a shard_map over the heads, none refused.
"""

from __future__ import annotations

import pytest

from kernels_pallas.common import TRITON_CALL
from kernels_pallas.ops import PallasOps
from metrale_jax import sharded_lowering
from metrale_jax_cli.recipes import REPO_RECIPES_DIR

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def test_the_80b_layer_group_lowers_for_8_h200s():
    exported = sharded_lowering.lower(sharded_lowering.MODEL, REPO_RECIPES_DIR, layers=4)
    assert sorted(exported) == ["decode", "prefill", "propose", "speculative", "verify"]
    for name, exp in exported.items():
        assert exp.nr_devices == 8, name
        assert exp.platforms == ("cuda",), name
        assert "all_reduce" in exp.mlir_module(), name


def test_the_80b_layer_group_lowers_for_8_h200s_with_the_pallas_forward():
    ops = PallasOps(interpret=False)
    before = ops.refusals()
    exported = sharded_lowering.lower(sharded_lowering.MODEL, REPO_RECIPES_DIR, layers=4, ops=ops)
    calls = {name: exp.mlir_module().count(TRITON_CALL) for name, exp in exported.items()}
    # 3 GDN layers and 1 attention layer per trunk pass; the MTP layer's attention once per draft
    assert calls == {"prefill": 4, "decode": 4, "verify": 4, "propose": 3, "speculative": 7}
    for name, exp in exported.items():
        assert exp.nr_devices == 8 and exp.mlir_module().count("sdy.manual_computation(") >= calls[name], name
    assert ops.refusals() == before
