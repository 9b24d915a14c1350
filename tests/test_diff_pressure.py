"""The `--prefill` cached leg under pressure (`diff.pressure.pressure_leg`): it evicts every step,
keeps a held sequence's bytes, asserts namespace isolation, and FAILs a planted LRU bug (a block
referenced again stays evictable) and a hash chain that ignores the namespace."""

from __future__ import annotations

import pytest
from conftest import settings
from diff_mutants import planted_coverage

from metrale_jax.diff.pressure import PRESSURE_STEPS, pressure_leg
from metrale_jax.diff.prompts import prompt_of_len
from metrale_jax.engine.engine import Engine

LENGTH = 40


@pytest.fixture(scope="module")
def engine(tiny):
    cfg, params = tiny
    flags = dict(max_batch_size=4, max_seq_len=64, speculative=True, num_drafts=3, block_size=8)
    return Engine(cfg, params, settings(enable_prefix_caching=True, ssm_cache_slots=2, **flags))


def _leg(engine):
    free = engine.blocks.kv.free_count
    tail = prompt_of_len(6, engine.cfg.vocab_size)[1:]
    entry, reasons = pressure_leg(engine, prompt_of_len(LENGTH, engine.cfg.vocab_size), tail)
    assert engine.blocks.kv.free_count + engine.blocks.prefix.kv.evictable >= free - 1
    assert engine.blocks.slots.live == 0
    return entry, reasons


def test_the_pressure_leg_evicts_every_step_and_keeps_namespaces_apart(engine):
    entry, reasons = _leg(engine)
    assert reasons == []
    assert len(entry["evictions_per_step"]) == PRESSURE_STEPS and all(entry["evictions_per_step"][1:])
    assert (
        entry["held_restored_at"] > 0
        and entry["held_state_equal"]
        and entry["other_namespace"] == [{"restored_at": 0, "shared_blocks": 0}] * 2
    )


@pytest.mark.parametrize(
    "name, why", [("lru-keeps-referenced", "changed under eviction"), ("keys-ignore-namespace", "restored")]
)
def test_a_planted_eviction_or_namespace_bug_fails_the_leg(engine, name, why):
    with planted_coverage(engine, name):
        _, reasons = _leg(engine)
    assert reasons and any(why in r for r in reasons), reasons
    _, reasons = _leg(engine)
    assert reasons == [], "the mutant is gone after the block"
