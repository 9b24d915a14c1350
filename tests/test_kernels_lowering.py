"""GPU lowering of every Pallas kernel, checked on a CPU-only machine.

Claims: at Qwen3-Next / Qwen3.5 shapes (attention head dims 128/256, GQA 8:1 and 16:2, block size
16; GDN value heads 32 and 64 over 16 key heads, dk = dv = 128) each kernel, called through its
api with interpret=False, exports for CUDA (abstract H200) into a module holding the Triton custom
call, and every array in the Triton IR has power-of-two dimensions; shapes Triton cannot take are
refused by `*_supported` before lowering (and do fail to lower when forced past the check).
Compiling the Triton IR to PTX needs a GPU: benchmarks/gpu_check.sh does that.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax._src.pallas.triton import lowering as triton_lowering  # private: only to read the Triton IR
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from kernels_pallas import common, testing
from kernels_pallas.common import KernelRefused
from kernels_pallas.gdn import api as gdn_api
from kernels_pallas.gdn import pallas_gpu as gdn_kernels
from kernels_pallas.ops import PallasInvariantOps, PallasOps
from kernels_pallas.paged_attention import api as attn_api
from kernels_pallas.paged_attention.pallas_gpu import INVARIANT_BLOCK_ROWS, AttentionTiling

try:
    from jax.sharding import AbstractDevice
except ImportError:  # jax 0.11.x
    from jax._src.mesh import AbstractDevice

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

TRITON = common.TRITON_CALL
H200 = AbstractMesh(
    (1,),
    ("x",),
    axis_types=(AxisType.Explicit,),
    abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda"),
)


@pytest.fixture
def triton_ir(monkeypatch):
    """The textual Triton IR of every kernel lowered while the fixture is active."""
    modules = []
    lower = triton_lowering.lower_jaxpr_to_triton_module

    def recording(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(result.module.operation.get_asm())
        return result

    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", recording)
    return modules


def export_cuda(fn, *args) -> str:
    with jax.sharding.use_abstract_mesh(H200):
        exported = jax.export.export(
            jax.jit(fn), platforms=["cuda"], disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)]
        )(*args)
    return exported.mlir_module()


def assert_pow2_tensors(asm: str):
    import re

    for dims in re.findall(r"tensor<((?:\d+x)+)", asm):
        for n in dims.rstrip("x").split("x"):
            assert common.is_pow2(int(n)), f"non power-of-two tensor dim {n} in Triton IR"


def gdn_args(b, t, h, hk=16, dk=128, dv=128):
    return testing.gdn_abstract_args(b, t, hk, h, dk, dv)


def attn_args(b, t, h, kvh, d, bs=16, nb=512, mb=64, dtype=jnp.bfloat16):
    return testing.attention_abstract_args(b, t, h, kvh, d, bs=bs, nb=nb, mb=mb, dtype=dtype)


@pytest.mark.parametrize("h", [32, 64])
@pytest.mark.parametrize("t", [1, 3, 4])
def test_gdn_rows_lowers(triton_ir, h, t):
    text = export_cuda(functools.partial(gdn_api.recurrent_gated_delta_rule, interpret=False), *gdn_args(8, t, h))
    assert TRITON in text and len(triton_ir) == 1
    assert_pow2_tensors(triton_ir[0])


@pytest.mark.parametrize("h", [32, 64])
@pytest.mark.parametrize("t", [130, 4096])
def test_gdn_chunk_lowers(triton_ir, h, t):
    text = export_cuda(functools.partial(gdn_api.chunk_gated_delta_rule, interpret=False), *gdn_args(2, t, h))
    assert TRITON in text and len(triton_ir) == 1
    assert_pow2_tensors(triton_ir[0])


@pytest.mark.parametrize("h,kvh", [(8, 1), (16, 2)])
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("t", [1, 4, 512])
def test_paged_attention_lowers(triton_ir, h, kvh, d, t):
    fn = functools.partial(attn_api.paged_attention, scale=d**-0.5, interpret=False)
    text = export_cuda(fn, *attn_args(4, t, h, kvh, d))
    assert TRITON in text and len(triton_ir) == 1
    assert_pow2_tensors(triton_ir[0])


def test_pallas_ops_lowers_every_kernel(triton_ir):
    """The engine's ops object with interpret=False: three Triton kernels, no refusal."""
    ops = PallasOps(interpret=False)
    assert ops.backend == "gpu"

    def step(q, k, v, g, beta, h0, aq, kc, vc, tables, pos):
        o_rows, _ = ops.gdn_rows(q, k, v, g, beta, h0)
        kc, vc = ops.write_kv(kc, vc, aq[:, :, :2], aq[:, :, :2], tables, pos, 0)
        return o_rows, ops.attention(aq, kc, vc, tables, pos, 256**-0.5)

    before = ops.refusals()
    text = export_cuda(step, *gdn_args(4, 4, 32), *attn_args(4, 4, 16, 2, 256))
    assert text.count(TRITON) == 2 and len(triton_ir) == 2
    assert ops.refusals() == before


@pytest.mark.parametrize("t", [1, 8])
def test_pallas_invariant_ops_lower_every_kernel(triton_ir, t):
    """The batch-invariant configuration compiled (`PallasInvariantOps(interpret=False)`): the rows, chunk and
    attention kernels lower as Triton calls, no refusal, the attention in row blocks of
    `INVARIANT_BLOCK_ROWS` whatever the query count (GQA 8:1: 8 rows are 64 rows of a kv head)."""
    ops = PallasInvariantOps(interpret=False)

    def step(q, k, v, g, beta, h0, aq, kc, vc, tables, pos):
        o_rows, _ = ops.gdn_rows(q, k, v, g, beta, h0)
        o_chunk, _ = ops.gdn_chunk(q, k, v, g, beta, h0)
        return o_rows, o_chunk, ops.attention(aq, kc, vc, tables, pos, 256**-0.5)

    before = ops.refusals()
    text = export_cuda(step, *gdn_args(4, t, 32), *attn_args(4, t, 16, 2, 256))
    assert text.count(TRITON) == 3 and len(triton_ir) == 3
    assert f"paged_attention_bm{INVARIANT_BLOCK_ROWS}_" in text
    assert ops.refusals() == before


def test_pallas_ops_lower_on_each_devices_heads_under_a_tensor_axis(triton_ir):
    """On an abstract (ep 1, tp 2) mesh of H200s with head-sharded arguments, as the engine shards
    them, the GDN and attention kernels lower as Triton calls inside shard_maps (one per op: each
    device runs its own heads), a program of 2 devices, no refusal."""
    mesh = AbstractMesh((1, 2), ("ep", "tp"), axis_types=(AxisType.Auto,) * 2, abstract_device=H200.abstract_device)
    ops = PallasOps(interpret=False)
    h2, h3, h4 = P(None, None, "tp"), P(None, None, "tp", None), P(None, "tp", None, None)
    specs = (h3, h3, h3, h2, h2, h4, h3, h3, h3, P(), P())
    args = [
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
        for x, spec in zip((*gdn_args(4, 4, 32), *attn_args(4, 4, 16, 2, 256)), specs)
    ]

    def step(q, k, v, g, beta, h0, aq, kc, vc, tables, pos):
        o_rows, _ = ops.gdn_rows(q, k, v, g, beta, h0)
        return o_rows, ops.attention(aq, kc, vc, tables, pos, 256**-0.5)

    before = ops.refusals()
    with jax.sharding.use_abstract_mesh(mesh):
        exported = jax.export.export(
            jax.jit(step), platforms=["cuda"], disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)]
        )(*args)
    text = exported.mlir_module()
    assert exported.nr_devices == 2
    assert text.count(TRITON) == 2 and text.count("sdy.manual_computation(") == 2 and len(triton_ir) == 2
    assert ops.refusals() == before


@pytest.mark.parametrize(
    "kernel,args,needle",
    [
        ("gdn_rows", gdn_args(2, 4, 32, dk=96), "dk=96"),
        ("gdn_chunk", gdn_args(2, 130, 32, dk=96), "dk=96"),
        ("attention", attn_args(2, 1, 8, 1, 96), "head_dim=96"),
        ("attention", attn_args(2, 1, 8, 1, 128, bs=12), "tile_keys=60"),
    ],
)
def test_refused_before_lowering(triton_ir, kernel, args, needle):
    """Triton rejects these shapes at lowering; the api refuses them first, with the reason."""
    api_fn, forced = {
        "gdn_rows": (
            gdn_api.recurrent_gated_delta_rule,
            functools.partial(gdn_kernels.recurrent_gated_delta_rule, tiling=gdn_kernels.RowsTiling(block_v=32)),
        ),
        "gdn_chunk": (
            gdn_api.chunk_gated_delta_rule,
            functools.partial(gdn_kernels.chunk_gated_delta_rule, tiling=gdn_kernels.ChunkTiling(block_v=64)),
        ),
        "attention": (
            functools.partial(attn_api.paged_attention, scale=0.1),
            functools.partial(
                attn_api.pallas_gpu.paged_attention, scale=0.1, tiling=AttentionTiling(block_rows=16, pages=4)
            ),
        ),
    }[kernel]
    with pytest.raises(KernelRefused, match=needle):
        export_cuda(functools.partial(api_fn, interpret=False), *args)
    assert not triton_ir
    with pytest.raises(ValueError, match="power of 2"):
        export_cuda(functools.partial(forced, interpret=False), *args)


def test_dot_minimum_refused():
    """A dot under 16 passes export but not Triton's compiler, so only the check can catch it."""
    reason = gdn_api.gdn_chunk_supported(*gdn_args(2, 64, 2, hk=1, dk=8, dv=8), backend="gpu")
    assert reason is not None and ">= 16" in reason
