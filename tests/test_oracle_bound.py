"""The diff oracle's bound for a model computing in bf16 (`diff.oracle.compute_rtol`), and the argmax
rule under it (`Contract.argmax_gap`): a flip is excused only where the reference's own gap between
the two argmaxes is within the bound, and a greedy draft chain that so flips is judged up to the
flip (`compare.draft_chain_cuts`); the oracle's control fires only where the clean run keeps the
contract (`oracle.broke_from`).

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
from metrale_jax.diff.compare import Contract, Part, Recording, bounded, compare, diff_part, propose_parts
from metrale_jax.diff.oracle import (
    ORACLE,
    ORACLE_CONTRACT,
    ORACLE_RTOL_ROUNDED,
    ORACLE_SIGMAS,
    broke_from,
    compute_rtol,
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
    logits, drafts = np.asarray(logits, np.float32), np.asarray(drafts, np.int32)
    return propose_parts(drafts, np.max(logits, axis=-1), logits)


# Three drafts over a vocabulary of 3. Each sequence's reference drafts are its argmaxes.
REF_LOGITS = [[[1.0, -1.0, 0.995], [0.0, 1.0, -1.0], [1.0, 0.0, -1.0]]] * 3
REF_DRAFTS = [[0, 1, 0]] * 3


def _flipped(gap_row: float, later: float):
    """The reference with sequence 0's draft 1 flipped to token 2 (its reference logit moved to
    `gap_row`), the drafts after it following that token (their logits `later` everywhere)."""
    logits = np.array(REF_LOGITS, np.float32)
    logits[0, 0, 2] = gap_row
    logits[0, 1:] = later
    drafts = np.array(REF_DRAFTS)
    drafts[0] = [2, 2, 2]
    return logits, drafts


def _judged(run_logits, run_drafts, contract, ref_logits=REF_LOGITS):
    view = Recording(prefill=[], steps=[_propose_step(ref_logits, REF_DRAFTS)])
    run = Recording(prefill=[], steps=[_propose_step(run_logits, run_drafts)])
    return compare("test", view, run, contract)


def test_a_draft_chain_is_judged_up_to_a_flip_within_the_references_gap():
    """Sequence 0's first draft flips 0 -> 2 where the reference's gap is 0.005 (within 1e-2 of
    max |ref| 1): its later drafts, their logits and confidences follow another token and are not
    judged; everything before and at the flip is."""
    contract = Contract(1e-2, "test", argmax_gap=True)
    logits, drafts = _flipped(1.001, later=5.0)
    c = _judged(logits, drafts, contract)
    assert c.ok and c.excused_draft_flips == 1 and c.mismatched_steps == 1
    # a flip over a gap past the bound (the reference's 2nd choice 0.9 below): the draft fails
    far = np.array(REF_LOGITS, np.float32)
    far[0, 0, 2] = 0.9
    c = _judged(logits, drafts, contract, ref_logits=far)
    assert not c.ok and c.excused_draft_flips == 0 and c.first_violation["part"] == "draft 1 logits"
    # the flipped position's own logits stay judged: a far value there fails
    bad = logits.copy()
    bad[0, 0, 1] = 0.5
    c = _judged(bad, drafts, contract)
    assert not c.ok and (c.first_violation["part"], c.first_violation["row"]) == ("draft 1 logits", 0)
    # another sequence's later draft stays judged
    other = logits.copy()
    other[1, 2, 0] = 3.0
    assert not _judged(other, drafts, contract).ok
    # without the gap rule the flip is a violation
    assert not _judged(logits, drafts, bounded(1e-2, "no gap rule")).ok


def test_a_control_fires_only_where_the_clean_run_keeps_the_contract():
    """The oracle's control counts a broken step only where the clean comparison keeps its
    contract there: a control that repeats the clean run's own violations detected nothing."""
    contract = bounded(1e-2, "test")
    ref = Recording(prefill=[], steps=[[_logits([[1.0, 0.0]])] for _ in range(4)])
    broken = [[_logits([[0.0, 1.0]])] for _ in range(4)]
    clean_ok = compare("clean", ref, Recording(prefill=[], steps=[list(s) for s in ref.steps]), contract)
    clean_bad = compare("clean", ref, Recording(prefill=[], steps=broken), contract)
    control = compare("control", ref, Recording(prefill=[], steps=ref.steps[:2] + broken[2:]), contract)
    assert broke_from(control, 2, clean_ok) and not broke_from(control, 4, clean_ok)
    assert not broke_from(control, 2, clean_bad)
