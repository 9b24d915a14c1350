"""The coverage mutants (`diff_mutants.COVERAGE_MUTANTS`) each FAIL the diff mode that fits, where
they first show: the prefix-cache bugs FAIL `--prefill` (prefix caching on) in its pressure leg, the
swap record that drops the partial drafter block FAILs `--swap`'s oracle at the last step's state
(the drafter KV: decode logits never read it); on `--verify-batch 8 --tier-slots --vocab-stress`,
the tier-capacity bug FAILs the `oracle` (every forward shares the overflow into the neighbour
slot's verify rows) and the sentinel bug FAILs `fused` at its `accepted` part (only a full accept
below K_max whose last argmax is 0 shows it: the stressed head makes those, the low tiers' K = 2
sequences give K < K_max). Their fast checks: tests/test_diff_pressure.py,
tests/test_prefix_cache_machine.py, tests/test_swap_bytes.py, tests/test_diff_tiers.py,
tests/test_acceptance_properties.py."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import settings
from diff_mutants import planted_coverage

from metrale_jax.diff import DiffRequest, Variant, run_diff
from metrale_jax.diff.oracle import ORACLE
from metrale_jax.diff.request import CACHED_MIN_TOKENS
from metrale_jax.diff.schedule import tier_slots
from metrale_jax.diff.variants import FUSED, default_variants
from metrale_jax.engine.capacity import DEFAULT_K_LADDER
from metrale_jax.engine.engine import Engine

XLA_REPEAT = [Variant("xla-repeat", "xla")]


@pytest.fixture(scope="module")
def cached_engine(tiny):
    cfg, params = tiny
    flags = dict(max_batch_size=2, max_seq_len=CACHED_MIN_TOKENS + 64, speculative=True, num_drafts=3)
    return Engine(cfg, params, settings(enable_prefix_caching=True, ssm_cache_slots=2, **flags))


@pytest.fixture(scope="module")
def engine(tiny):
    cfg, params = tiny
    return Engine(cfg, params, settings(max_batch_size=4, max_seq_len=96, speculative=True, num_drafts=3))


PREFILL = DiffRequest(steps=2, prefill=(CACHED_MIN_TOKENS,))


def test_the_clean_tree_passes_the_pressure_leg(cached_engine):
    report = run_diff(cached_engine, PREFILL, XLA_REPEAT)
    assert report["verdict"] == "PASS", report["reasons"]
    (entry,) = report["pressure"]
    assert all(entry["evictions_per_step"][1:]) and entry["held_state_equal"]


@pytest.mark.parametrize(
    "name, why", [("lru-keeps-referenced", "changed under eviction"), ("keys-ignore-namespace", "restored")]
)
def test_a_prefix_cache_mutant_fails_the_prefill_diff(cached_engine, name, why):
    with planted_coverage(cached_engine, name):
        report = run_diff(cached_engine, PREFILL, XLA_REPEAT)
    assert report["verdict"] == "FAIL"
    assert any("under pressure" in r and why in r for r in report["reasons"]), report["reasons"]


def test_a_swap_record_missing_the_partial_drafter_block_fails_the_swap_oracle(engine):
    request = DiffRequest(steps=4, swap=True)
    with planted_coverage(engine, "swap-drops-partial-drafter-block"):
        report = run_diff(engine, request, default_variants([ORACLE])[0])
    assert report["verdict"] == "FAIL" and not report["oracle"]["ok"]
    where = report["oracle"]["first_violation"]
    assert where["step"] == request.steps - 1 and where["part"].startswith("mtp layer 0 kv"), where


#: The tiered, stressed verify: 8 sequences on slots 0, 1, 4, 5, 8, 9, 16, 17 (two per ladder step).
TIERED = DiffRequest(steps=4, verify_batch=(8,), verify_batch_ks=(4,), tier_slots=True, vocab_stress=True)


@pytest.fixture(scope="module")
def tiered_engine(tiny):
    cfg, params = tiny
    slots = TIERED.slots_needed(DEFAULT_K_LADDER)
    flags = dict(max_batch_size=slots, max_seq_len=128, speculative=True, num_drafts=3)
    return Engine(dataclasses.replace(cfg, vocab_stress=True), params, settings(**flags))


def _tiered(engine, *labels):
    return run_diff(engine, TIERED, default_variants(labels)[0])


def test_the_clean_tree_passes_the_tiered_stressed_verify(tiered_engine):
    report = _tiered(tiered_engine, FUSED, ORACLE)
    assert report["verdict"] == "PASS", report["reasons"]
    (shape,) = report["shapes"]
    assert shape["slots"] == list(tier_slots(8, DEFAULT_K_LADDER)) and shape["ks"] == [4] * 4 + [2] * 4
    assert shape["edge_hits"]["full_accepts_below_k_max_then_0"] > 0 and shape["edge_hits"]["committed_last_id"] > 0


def test_a_slot_admitting_one_draft_too_many_fails_the_oracle(tiered_engine):
    """Sequence 4 (slot 8, one verify row) verifies K = 3: its second state lands on slot 9's row,
    which slot 9 overwrites; its partial accept at step 1 folds slot 9's state."""
    with planted_coverage(tiered_engine, "tier-capacity"):
        report = _tiered(tiered_engine, ORACLE)
    assert report["verdict"] == "FAIL"
    (shape,) = report["shapes"]
    assert shape["ks"] == [4] * 4 + [3] * 4, "the low tiers verify one draft more than their rows hold"
    (oracle,) = shape["comparisons"]
    where = oracle["first_violation"]
    assert not oracle["ok"] and (where["step"], where["part"]) == (1, "seq 4 layer 0 gdn h"), where


def test_a_sentinel_colliding_with_token_0_fails_the_fused_step(tiered_engine):
    with planted_coverage(tiered_engine, "sentinel"):
        report = _tiered(tiered_engine, FUSED)
    assert report["verdict"] == "FAIL"
    (shape,) = report["shapes"]
    (fused,) = shape["comparisons"]
    where = fused["first_diff"]
    assert not fused["ok"] and (where["step"], where["part"], where["row"]) == (0, "accepted", 4), where
    assert (where["reference"], where["replay"]) == (1, 2), "one padding row counted as a draft"
