"""The diff's coverage of the K ladder's tiers and of the edge token ids, host-side and cheap.

`--tier-slots` (`schedule.tier_slots`) puts a verify batch's sequences in every tier of the ladder,
two to a tier when the width allows, so a slot's neighbour verifies in the same step;
`--vocab-stress` (`trunk.stress_edges`, the engine's own head) permutes each logits row so the
argmax lands on id 0 or the last id for a third of the rows each. The planted `tier-capacity`
mutant (a slot admitting one draft more than its verify rows hold) fails the capacity check here;
the diff runs of both coverage mutants are in tests/test_mutants_coverage.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import settings
from diff_mutants import planted_coverage

from metrale_jax.diff import DiffRequest
from metrale_jax.diff.request import DiffRequestError
from metrale_jax.diff.schedule import TierSpread, slot_of, tier_slots, tier_starts
from metrale_jax.engine.capacity import DEFAULT_K_LADDER, pool_counts
from metrale_jax.engine.engine import Engine
from metrale_jax.engine.sequences import SequenceState
from metrale_jax.model.trunk import stress_edges
from metrale_jax.presets import resolve_checkpoint
from metrale_jax_cli.main import cli

CFG, _ = resolve_checkpoint("tiny")


def _counts(slots: int):
    return pool_counts(settings(max_batch_size=slots, max_seq_len=64, speculative=True, num_drafts=3), CFG)


@pytest.mark.parametrize("n", [4, 5, 8, 9, 12])
def test_tier_slots_put_sequences_in_every_tier_of_the_ladder(n):
    slots = tier_slots(n, DEFAULT_K_LADDER)
    assert tier_starts(DEFAULT_K_LADDER) == [0, 4, 8, 16]
    assert len(slots) == n and all(a < b for a, b in zip(slots, slots[1:]))
    assert {0, 4, 8, 16} <= set(slots), "every tier's first slot holds a sequence"
    counts = _counts(slots[-1] + 1)
    assert {counts.slot_draft_capacity(s) for s in slots} == {3, 1}, "both draft capacities are verified"
    if n >= 8:
        assert {9, 17} <= set(slots), "a low tier's slot verifies next to its neighbour"
    assert [slot_of(i, n, TierSpread(DEFAULT_K_LADDER)) for i in range(n)] == list(slots)


def test_tier_slots_are_checked_against_the_ladder():
    request = DiffRequest(steps=4, verify_batch=(3,), verify_batch_ks=(4,), tier_slots=True)
    request.check()
    with pytest.raises(DiffRequestError, match="width 3 cannot hold a sequence in each of the K ladder's 4 tiers"):
        request.check_layout(DEFAULT_K_LADDER)
    wide = DiffRequest(steps=4, verify_batch=(4, 8), verify_batch_ks=(4,), tier_slots=True)
    assert wide.slots_needed(DEFAULT_K_LADDER) == 18 and wide.slots_needed() == 8
    for bad, message in [
        (DiffRequest(steps=4, verify=(2,), tier_slots=True), "--tier-slots applies to --verify-batch"),
        (
            DiffRequest(steps=4, verify_batch=(4,), verify_batch_ks=(2,), tier_slots=True, fragment_slots=True),
            "two slot layouts",
        ),
    ]:
        with pytest.raises(DiffRequestError, match=message):
            bad.check()


def test_the_stressed_head_moves_argmaxes_onto_the_edge_ids():
    logits = np.random.RandomState(7).randn(600, 256).astype(np.float32)
    out = np.asarray(stress_edges(jnp.asarray(logits)))
    top = logits.argmax(1)
    want = np.where(top % 3 == 1, 0, np.where(top % 3 == 2, 255, top))
    assert (out.argmax(1) == want).all()
    assert (np.sort(out, 1) == np.sort(logits, 1)).all(), "each row is a permutation of itself"
    assert 150 < (want == 0).sum() < 250 and 150 < (want == 255).sum() < 250


def _admitted_beyond_rows(engine) -> list[int]:
    """Slots where `Engine.can_batch_verify` admits a K whose drafts exceed the slot's verify rows."""
    counts = engine.counts
    out = []
    for slot in range(counts.mtp_slots):
        seq = SequenceState(seq_id=slot, slot=slot, seq_len=4)
        admitted = [k for k in range(1, counts.k + 1) if Engine.can_batch_verify(engine, [seq], [k]) is None]
        if max(admitted) - 1 > counts.h_steps[slot]:
            out.append(slot)
    return out


def test_no_slot_admits_more_drafts_than_its_verify_rows_hold_and_the_tier_mutant_does():
    engine = SimpleNamespace(counts=_counts(18), blocks=SimpleNamespace(prefix=None), save_sequence_state=None)
    assert _admitted_beyond_rows(engine) == []
    with planted_coverage(engine, "tier-capacity"):
        assert _admitted_beyond_rows(engine) == list(range(8, 18))
    assert _admitted_beyond_rows(engine) == []


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--verify-batch", "3", "--verify-batch-ks", "2", "--tier-slots"], "width 3 cannot hold a sequence in each"),
        (["--verify", "2", "--tier-slots"], "--tier-slots applies to --verify-batch"),
    ],
)
def test_a_bad_tier_layout_is_one_error_line_before_the_engine(flags, needle, tmp_path):
    out = tmp_path / "r.json"
    argv = ["diff", "--checkpoint", "tiny", "--steps", "4", "--speculative", "--out", str(out), *flags]
    r = CliRunner().invoke(cli, argv)
    assert r.exit_code == 2 and "Traceback" not in r.output, (r.exit_code, r.output)
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert needle in line and not out.exists()
