"""The batch-invariant mode (`--batch-invariant`): its settings, its refusals, its kernels' row invariance, and
its contract end to end on the tiny model (`tests/batch_invariant_contract.py`, in a process with FMA
contraction pinned).

Claims:
- The setting resolves (default off, `--batch-invariant` on), is refused on several devices, and an engine
  refuses the mode where XLA still contracts FMAs (this test process: the pin is a process flag).
- The rows kernel's invariant entry computes a row's product with the same bits at 1..40 rows, and
  `invariant_einsum` gives a row the same bits at any number of rows around it.
- Under the mode, bit for bit (f32, fp8 and bf16 KV; the `xla` forward and, on tiny, the `pallas` one): a decode alone
  equals the same decode in a batch of 4 (fragmented slots) and of 8; verify row j equals the plain decode
  after rows 0..j-1, and the state committed after the verdict equals the state after plain decodes of the
  accepted tokens; a prefill in chunks of 32 or 64 equals one pass; the MTP propose does not depend on the
  batch.
- The sub-bound mutants (`diff_mutants.SUB_BOUND_MUTANTS`: a committed state one ULP off) PASS the bounded
  oracle and FAIL it under --batch-invariant; the clean tree PASSes both.
- Without the setting the ops are the forwards' own (`ReferenceOps`, `PallasOps`): nothing changes; with it the
  `pallas` forward is `PallasInvariantOps` (the kernels' invariant configuration, tests/test_kernels_invariant.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from batch_invariant_einsum import CASES as EINSUM_CASES
from batch_invariant_einsum import case_name
from conftest import settings
from diff_mutants import SUB_BOUND_MUTANTS

from kernels_cpu.rows_matmul.api import kernel_unavailable, rows_matmul_invariant
from kernels_pallas.invariant import invariant_einsum
from kernels_pallas.ops import InvariantOps, PallasInvariantOps, PallasOps, ReferenceOps
from metrale_jax.engine.engine import Engine, make_ops
from metrale_jax.engine.sequences import EngineError
from metrale_jax.engine.settings import unsupported
from metrale_jax.runtime_env import FMA_PIN_FLAG

TESTS = Path(__file__).resolve().parent


def test_setting_resolves_and_is_refused_on_several_devices(tiny):
    cfg, _ = tiny
    assert settings().batch_invariant is False
    on = settings(batch_invariant=True)
    assert on.batch_invariant and unsupported(on, cfg) == []
    assert any(
        "--batch-invariant" in m for m in unsupported(settings(batch_invariant=True, tensor_parallel_size=2), cfg)
    )


def test_ops_follow_the_setting():
    assert make_ops("xla") == ReferenceOps() and make_ops("xla", True) == InvariantOps()
    assert InvariantOps().name != ReferenceOps().name
    assert make_ops("pallas", True) == PallasInvariantOps() and make_ops("pallas") == PallasOps()
    assert PallasInvariantOps().batch_invariant and PallasInvariantOps().name not in (PallasOps().name, "xla")


def test_engine_refuses_the_mode_without_the_fma_pin(tiny):
    if FMA_PIN_FLAG in os.environ.get("XLA_FLAGS", ""):
        pytest.skip("this process has the pin")
    cfg, params = tiny
    with pytest.raises(EngineError, match="FMA contraction"):
        Engine(cfg, params, settings(max_batch_size=2, max_seq_len=64, batch_invariant=True))


def test_rows_kernel_invariant_at_every_row_count():
    x = jax.random.normal(jax.random.key(0), (40, 96), jnp.float32)
    t = jax.random.normal(jax.random.key(1), (96, 40), jnp.float32)
    if kernel_unavailable(x, t):
        pytest.skip(kernel_unavailable(x, t))
    one = np.asarray(jax.jit(rows_matmul_invariant)(x[:1], t))
    for n in (1, 2, 7, 8, 9, 17, 40):
        got = np.asarray(jax.jit(rows_matmul_invariant)(x[:n], t))
        assert got[0].tobytes() == one[0].tobytes(), n
    np.testing.assert_allclose(got, np.asarray(x) @ np.asarray(t), rtol=1e-5, atol=1e-5)


def test_invariant_einsum_matches_einsum_and_ignores_the_rows_around():
    s = jax.random.normal(jax.random.key(2), (8, 3, 16, 12), jnp.float32)
    k = jax.random.normal(jax.random.key(3), (8, 3, 16), jnp.float32)
    spec = "bhkv,bhk->bhv"
    full = np.asarray(jax.jit(lambda s, k: invariant_einsum(spec, s, k))(s, k))
    np.testing.assert_allclose(full, np.einsum(spec, np.asarray(s), np.asarray(k)), rtol=1e-5, atol=1e-5)
    one = np.asarray(jax.jit(lambda s, k: invariant_einsum(spec, s, k))(s[:1], k[:1]))
    assert one.tobytes() == full[:1].tobytes()
    with pytest.raises(ValueError, match="exactly one index"):
        invariant_einsum("ab,bc->a", s[0, 0], k[0])


@pytest.mark.parametrize("spec, a_shape, b_shape", EINSUM_CASES)
def test_invariant_einsum_keeps_the_larger_operand_in_place_and_never_materialises_an_unrolled_product(
    spec, a_shape, b_shape
):
    """No transpose of the larger operand (the GDN state, a value tile) unless the summed index is the minor
    axis of both operands; a power-of-two length is the unrolled tree (no value of the product's size: n times
    the output), any other the materialised product whose sum tree's slices cut an axis other than the minor
    one. (The bits: `test_invariant_einsum_bits_are_the_materialised_trees`.)"""
    a = jax.random.normal(jax.random.key(4), a_shape, jnp.float32)
    b = jax.random.normal(jax.random.key(5), b_shape, jnp.float32)
    larger = a if a.size >= b.size else b
    inputs, out = spec.split("->")
    summed = next(c for c in inputs if c not in out and c != ",")
    in_place = not all(labels.endswith(summed) for labels in inputs.split(","))
    n = a_shape[inputs.index(summed)]
    unrolled = n & (n - 1) == 0
    jaxpr = jax.make_jaxpr(lambda a, b: invariant_einsum(spec, a, b))(a, b).jaxpr
    out_size = int(np.prod(jaxpr.outvars[0].aval.shape))
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "transpose" and in_place:
            assert eqn.invars[0].aval.shape != larger.shape, spec
        if unrolled:
            assert all(int(np.prod(v.aval.shape)) < n * out_size for v in eqn.outvars), (spec, eqn)
        elif eqn.primitive.name == "slice":
            rank = len(eqn.invars[0].aval.shape)
            assert eqn.params["limit_indices"][rank - 1] == eqn.invars[0].aval.shape[rank - 1], spec


def test_invariant_einsum_bits_are_the_materialised_trees(einsum_bits):
    """With FMA contraction pinned, `invariant_einsum` (unrolled or not) has the bits of `pairwise_sum` over the
    broadcast product with the summed index last, in every case of `batch_invariant_einsum.CASES`."""
    assert einsum_bits == {case_name(*case): True for case in EINSUM_CASES}


@pytest.fixture(scope="module")
def softmax_bits():
    """{case: [row counts at which a row's bits differ from it alone]} (`batch_invariant_softmax.py`)."""
    return _pinned("batch_invariant_softmax.py")


def test_the_modes_softmaxes_do_not_depend_on_the_rows_around_them(softmax_bits):
    """The MoE router's fenced softmax, the mode's log_softmax and the sampling law traced in the mode (its max
    fenced) give a row the same bits alone and among 2 to 1,024 rows; the unfenced forms they replace do not
    (the control: the cases reach the sizes where XLA CPU's fusion or sum order changes)."""
    assert softmax_bits["router exp(x - max), fenced"] == []
    assert softmax_bits["log_softmax, invariant"] == []
    assert softmax_bits["router exp(x - max), unfenced"] != []
    assert softmax_bits["log_softmax, jax"] != []
    assert softmax_bits["sampling probabilities, invariant"] == []
    assert softmax_bits["sampling probabilities, default"] != []


def _pinned(script: str, *argv: str) -> dict:
    """The JSON a script of tests/ prints, run in a process with XLA CPU's FMA contraction pinned."""
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {FMA_PIN_FLAG}".strip()}
    env.setdefault("JAX_PLATFORMS", "cpu")
    r = subprocess.run([sys.executable, script, *argv], env=env, capture_output=True, text=True, cwd=TESTS)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(
    scope="module",
    params=[
        ("tiny", "f32"),
        ("tiny", "fp8"),
        ("tiny", "bf16"),
        ("fixtures/hf/qwen3_next_moe", "f32"),
        ("tiny", "f32", "pallas"),
    ],
    ids=["tiny-f32", "tiny-fp8", "tiny-bf16", "qwen3_next_moe-f32", "tiny-f32-pallas"],
)
def contract(request):
    """{check: [compared parts, differing parts]} from the contract script on a model and KV dtype, with the FMA
    pin: tiny with a float32, an fp8 and a bfloat16 KV (a narrow KV rounds each written row once, and every reader
    reads those bytes), the HF-layout MoE fixture, and tiny on the `pallas` forward (the kernels' invariant
    configuration, interpreted)."""
    return _pinned("batch_invariant_contract.py", *request.param)


@pytest.fixture(scope="module")
def einsum_bits():
    """{case: bits equal} from `batch_invariant_einsum.py`, with the FMA pin."""
    return _pinned("batch_invariant_einsum.py")


@pytest.fixture(scope="module")
def mutants():
    """{bounded | invariant: {clean | mutant: [verdict, contract, first violation]}} (`batch_invariant_mutants.py`)."""
    return _pinned("batch_invariant_mutants.py")


def test_contract_bit_for_bit(contract):
    assert len(contract) == 11, sorted(contract)
    for name, (compared, differing) in contract.items():
        assert compared >= 1 and differing == [], name


def test_sub_bound_mutants_pass_the_bounded_oracle_and_fail_the_bit_identical_one(mutants):
    assert set(mutants["bounded"]) == {"clean", *SUB_BOUND_MUTANTS}
    for name, (verdict, contract, where) in mutants["bounded"].items():
        assert verdict == "PASS" and contract.startswith("bounded") and where is None, name
    for name, (verdict, contract, where) in mutants["invariant"].items():
        assert contract.startswith("bit-identical"), name
        assert (verdict, where is None) == (("PASS", True) if name == "clean" else ("FAIL", False)), name
