"""The coverage mutants (`diff_mutants.COVERAGE_MUTANTS`) each FAIL the diff mode that fits, where
they first show: the prefix-cache bugs FAIL `--prefill` (prefix caching on) in its pressure leg, the
swap record that drops the partial drafter block FAILs `--swap`'s oracle at the last step's state
(the drafter KV: decode logits never read it). Their fast checks: tests/test_diff_pressure.py,
tests/test_prefix_cache_machine.py, tests/test_swap_bytes.py."""

from __future__ import annotations

import pytest
from conftest import settings
from diff_mutants import planted_coverage

from metrale_jax.diff import DiffRequest, Variant, run_diff
from metrale_jax.diff.oracle import ORACLE
from metrale_jax.diff.request import CACHED_MIN_TOKENS
from metrale_jax.diff.variants import default_variants
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
