"""The mutation score of `metrale-jax diff`: every shared-code state bug of `diff_mutants.SHARED_MUTANTS`,
planted one at a time in the code every run shares (the reference's included), FAILs the diff with
the `oracle` variant, first at the step and comparison where the bug first shows; the clean tree
PASSes with the oracle's control firing; the stash check of tests/test_speculative.py catches the
wrong-row stash.

Where each bug first shows follows from the clean reference's accept log: a partial accept (the
fold, the commit, the rewind, the write-on-accept rows), a partial accept of at least one draft (a
fold one row early), a full accept (a full accept folded as partial), the first step (a stash, trim,
padding or block-table bug), the prefill (a chunk boundary), the step after the spill (a swap-in),
a partial accept under replay rollback (its checkpoint restore). One tiny engine (and one with replay
rollback), three sequences at K = 4 (a padded batch: three sequences take a width-4 program).
"""

from __future__ import annotations

import pytest
import test_speculative
from conftest import settings
from diff_mutants import SHARED_MUTANTS, MutantEngine, planted, stash_error

from metrale_jax.diff import DiffRequest, run_diff
from metrale_jax.diff.oracle import ORACLE, ORACLE_RTOL
from metrale_jax.diff.variants import default_variants

VERIFY = DiffRequest(steps=3, verify_batch=(3,), verify_batch_ks=(4,), mtp=True)
SWAP = DiffRequest(steps=4, swap=True)
ORACLE_ONLY = default_variants([ORACLE])[0]


@pytest.fixture(scope="module")
def engine(tiny):
    cfg, params = tiny
    return MutantEngine(cfg, params, settings(max_batch_size=8, max_seq_len=128, speculative=True, num_drafts=3))


@pytest.fixture(scope="module")
def clean(engine):
    report = run_diff(engine, VERIFY, ORACLE_ONLY)
    assert report["verdict"] == "PASS", report["reasons"]
    return report


def _first(accepted, k: int, pick) -> tuple[int, int]:
    """The first (step, sequence) whose accepted count satisfies `pick(na, k)`."""
    return next((s, i) for s, acc in enumerate(accepted) for i, a in enumerate(acc) if pick(a, k))


def _expected(name: str, accepted, cfg) -> tuple[int | str, str]:
    """(step, part) where the oracle first sees shared mutant `name`, from the clean accept log."""
    gdn, attn = cfg.linear_layer_ids[0], cfg.full_layer_ids[0]
    partial = _first(accepted, 4, lambda a, k: a < k - 1)
    where = {
        "fold-row-late": (partial, f"layer {gdn} gdn h"),
        "fold-row-early": (_first(accepted, 4, lambda a, k: 1 <= a < k - 1), f"layer {gdn} gdn h"),
        "full-as-partial": (_first(accepted, 4, lambda a, k: a == k - 1), f"layer {gdn} gdn h"),
        "conv-commit-off-by-one": (partial, f"layer {gdn} gdn conv"),
        "rejected-kv-visible": (partial, f"layer {attn} kv k"),
        "write-on-accept-shifted": (partial, f"layer {gdn} gdn h"),
        "stash-wrong-row": ((0, 0), "mtp stash"),
        "propose-untrimmed": ((0, 0), "mtp layer 0 kv k"),
        "padding-slot-0": ((0, 0), f"layer {gdn} gdn h"),
        "block-table-off-by-one": ((0, 0), "logits"),
    }
    if name == "prefill-chunk-overlap":
        return "prefill", "logits"
    (step, seq), part = where[name]
    return step, f"seq {seq} {part}"


def test_the_clean_tree_passes_with_the_oracles_control_firing(clean):
    (shape,) = clean["shapes"]
    (c,) = shape["comparisons"]
    assert c["variant"] == ORACLE and c["ok"] and c["argmax_equal"] and c["steps"] == VERIFY.steps
    control = shape["oracle_detection_control"]
    assert control["fired"] and min(control["violating_steps"]) == VERIFY.steps // 2
    assert shape["full_accepts"] and shape["partial_accepts"]


VERIFY_MUTANTS = [m for m in SHARED_MUTANTS if "restore" not in m]


@pytest.mark.parametrize("name", VERIFY_MUTANTS)
def test_each_shared_mutant_fails_the_oracle_where_it_first_shows(engine, clean, name):
    with planted(engine, name):
        report = run_diff(engine, VERIFY, ORACLE_ONLY)
    (c,) = report["shapes"][0]["comparisons"]
    step, part = _expected(name, clean["shapes"][0]["accepted"], engine.cfg)
    assert report["verdict"] == "FAIL" and not c["ok"], name
    assert (c["first_violation"]["step"], c["first_violation"]["part"]) == (step, part), c["first_violation"]
    assert any(r.startswith(f"verify-batch n=3 ks=[4, 4, 4], {ORACLE} (bounded)") for r in report["reasons"])


def test_a_swap_in_that_skips_the_conv_window_fails_the_oracle_after_the_spill(engine):
    clean = run_diff(engine, SWAP, ORACLE_ONLY)
    assert clean["verdict"] == "PASS", clean["reasons"]
    assert clean["oracle"]["ok"] and clean["oracle"]["mismatched_steps"] == 0, "never spilled: bit-identical"
    assert clean["oracle_detection_control"]["mismatched_steps"]
    with planted(engine, "restore-skips-conv"):
        report = run_diff(engine, SWAP, ORACLE_ONLY)
    assert report["verdict"] == "FAIL"
    where = report["oracle"]["first_violation"]
    assert (where["step"], where["part"]) == (SWAP.steps // 2, "logits"), where


def test_the_named_stash_test_catches_the_wrong_rows_hidden(engine):
    prompts = [list(range(3, 20))]
    test_speculative.test_the_stash_holds_the_accepted_rows_hidden(engine, prompts)
    with planted(engine, "stash-wrong-row"), pytest.raises(AssertionError):
        test_speculative.test_the_stash_holds_the_accepted_rows_hidden(engine, prompts)
    with planted(engine, "stash-wrong-row"):
        assert stash_error(engine, prompts[0]) > 100 * ORACLE_RTOL, "another row's hidden is O(1) off"


@pytest.fixture(scope="module")
def replay_engine(tiny):
    cfg, params = tiny
    return MutantEngine(
        cfg,
        params,
        settings(max_batch_size=8, max_seq_len=128, speculative=True, num_drafts=3, ssm_rollback_mode="replay"),
    )


@pytest.fixture(scope="module")
def replay_clean(replay_engine):
    return run_diff(replay_engine, VERIFY, ORACLE_ONLY)


def test_replay_rollback_passes_the_oracle(replay_clean):
    """Regression: replay rollback's commit re-runs the accepted rows, and their drafter catch-up
    pairs row 0 with the stash; `Engine.accept` stashed the accepted row's hidden before the commit,
    so that pair read the wrong hidden (drafts only: greedy equality held)."""
    assert replay_clean["verdict"] == "PASS", replay_clean["reasons"]


def test_a_checkpoint_restore_that_skips_the_conv_window_fails_the_oracle(replay_engine, replay_clean):
    """Replay rollback: a partial accept restores the pre-verify checkpoint and re-runs the accepted
    rows; without the conv window the re-run starts from the wrong window."""
    with planted(replay_engine, "checkpoint-restore-skips-conv"):
        report = run_diff(replay_engine, VERIFY, ORACLE_ONLY)
    (c,) = report["shapes"][0]["comparisons"]
    step, seq = _first(replay_clean["shapes"][0]["accepted"], 4, lambda a, k: a < k - 1)
    where = c["first_violation"]
    gdn = replay_engine.cfg.linear_layer_ids[0]
    assert report["verdict"] == "FAIL" and (where["step"], where["part"]) == (step, f"seq {seq} layer {gdn} gdn h"), (
        where
    )
