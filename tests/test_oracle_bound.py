"""The diff oracle's bound for a model computing in bf16 (`diff.oracle.compute_rtol`), and the argmax
rule under it (`Contract.argmax_gap`): a flip is excused only where the reference's own gap between
the two argmaxes is within the bound.

Measured on a small HF-initialised model served in bf16 (the `qwen3_5_dense` fixture, bf16
weights, compute and KV): the clean tree PASSes the oracle under the bf16 contract and a planted
shared-code bug (`diff_mutants.SHARED_MUTANTS`) still FAILs it; a float32 model keeps the
float32 contract (the report on `tiny` is unchanged).
"""

from __future__ import annotations

import math
import os

import ml_dtypes
import numpy as np
import pytest
from conftest import FIXTURES, settings
from diff_mutants import MutantEngine, planted

from metrale_jax.checkpoint import load_checkpoint
from metrale_jax.diff import DiffRequest, run_diff
from metrale_jax.diff.compare import Contract, Part, Recording, bounded, diff_part
from metrale_jax.diff.oracle import (
    ORACLE,
    ORACLE_CONTRACT,
    ORACLE_RTOL_ROUNDED,
    ORACLE_SIGMAS,
    compute_rtol,
    excuse_last_draft_ties,
    oracle_contract,
    rounding_stages,
)
from metrale_jax.diff.variants import default_variants
from metrale_jax.engine.engine import Engine

BF16_EPS = 2.0**-7
VERIFY = DiffRequest(steps=3, verify_batch=(3,), verify_batch_ks=(4,), mtp=True)
PLANTED = "fold-row-late"


def test_the_bf16_bound_is_the_spread_of_its_rounding_stages(tiny):
    cfg, _ = tiny
    n = rounding_stages(cfg)
    assert n == cfg.num_hidden_layers + cfg.num_mtp_layers + 1
    assert compute_rtol(ml_dtypes.bfloat16, cfg) == ORACLE_SIGMAS * math.sqrt(n) * BF16_EPS
    deeper = cfg.replace(num_hidden_layers=24, layer_types=cfg.layer_types[:1] * 24)
    assert compute_rtol(ml_dtypes.bfloat16, deeper) > compute_rtol(ml_dtypes.bfloat16, cfg)


def test_a_float32_model_keeps_the_float32_contract(tiny):
    cfg, params = tiny
    eng = Engine(cfg, params, settings(max_batch_size=2, max_seq_len=64))
    assert oracle_contract(eng) == ORACLE_CONTRACT and not ORACLE_CONTRACT.argmax_gap
    assert "argmax equal (" in ORACLE_CONTRACT.describe()


def _logits(rows):
    return Part("logits", np.asarray(rows, np.float32), "logits")


def test_an_argmax_flip_is_excused_only_within_the_references_gap():
    tol_contract = Contract(1e-2, "test", argmax_gap=True)
    ref = _logits([[1.0, 0.995, -1.0], [1.0, 0.9, -1.0]])
    near = _logits([[0.996, 0.999, -1.0], [1.0, 0.9, -1.0]])  # row 0 flips over a 0.005 gap (tol 0.01)
    assert diff_part(ref, near, tol_contract).violation is None
    assert diff_part(ref, near, bounded(1e-2, "no gap rule")).violation["why"] == "argmax differs"
    far = _logits([[1.0, 0.995, -1.0], [0.905, 0.91, -1.0]])  # row 1 flips over a 0.1 gap
    v = diff_part(ref, far, tol_contract).violation
    assert v is not None and v["row"] == 1


@pytest.fixture(scope="module")
def bf16_engine():
    cfg, params = load_checkpoint(os.path.join(FIXTURES, "hf", "qwen3_5_dense"), ml_dtypes.bfloat16)
    st = settings(max_batch_size=8, max_seq_len=128, speculative=True, num_drafts=3, kv_cache_dtype="bf16")
    return MutantEngine(cfg, params, st)


def test_a_bf16_model_passes_the_oracle_and_a_planted_bug_fails_it(bf16_engine):
    contract = oracle_contract(bf16_engine)
    assert contract.argmax_gap and contract.rtol == max(
        ORACLE_RTOL_ROUNDED, compute_rtol(ml_dtypes.bfloat16, bf16_engine.cfg)
    )
    assert "bfloat16 compute" in contract.describe()
    variants = default_variants([ORACLE])[0]
    clean = run_diff(bf16_engine, VERIFY, variants)
    assert clean["verdict"] == "PASS", clean["reasons"]
    with planted(bf16_engine, PLANTED):
        bug = run_diff(bf16_engine, VERIFY, variants)
    assert bug["verdict"] == "FAIL" and any("oracle" in r for r in bug["reasons"]), bug["reasons"]


def _propose_step(logits, drafts):
    return [
        Part("propose logits", np.asarray(logits, np.float32), "logits"),
        Part("drafts", np.asarray(drafts, np.int32), "tokens"),
        Part("confidences", np.zeros(np.shape(drafts), np.float32), "values"),
    ]


def test_a_last_draft_flip_is_excused_only_within_the_references_gap():
    contract = Contract(1e-2, "test", argmax_gap=True)
    logits = [[1.0, 0.995, -1.0], [1.0, 0.9, -1.0], [1.0, 0.999, -1.0]]
    view = Recording(prefill=[], steps=[_propose_step(logits, [[2, 0], [2, 0], [2, 0]])])
    # row 0: last draft flips over a 0.005 gap; row 1: over a 0.1 gap; row 2: its first draft flips
    run = Recording(prefill=[], steps=[_propose_step(logits, [[2, 1], [2, 1], [1, 1]])])
    run.steps[0][1].data.flags.writeable = False  # as the engine's outputs are
    assert excuse_last_draft_ties(view, run, contract) == 1
    assert run.steps[0][1].data.tolist() == [[2, 0], [2, 1], [1, 1]]
    assert excuse_last_draft_ties(view, run, bounded(1e-2, "no gap rule")) == 0
