"""Speculative generation on the shipped `small` preset (a trained MTP head, so drafts are
accepted and widths shrink at different steps): the fused and the composed step paths take the
same steps under a K ladder and a confidence stop, emit plain greedy's tokens and compile nothing
once warmed up; `progress` counts every emitted token; the stash holds the accepted row's hidden;
the held-out acceptance by draft position stays at its measured value on both paths. Shares
`research.study_for("small")`'s engine with test_research."""

import json
import os

import numpy as np
import pytest
from diff_mutants import stash_error

from metrale_jax import research
from metrale_jax.diff.oracle import ORACLE_RTOL
from metrale_jax.engine.speculative import DraftSchedule, greedy_generate, speculative_generate
from metrale_jax.presets_data import SMALL_DIR


@pytest.fixture(scope="module")
def engine():
    return research.study_for("small").engine


@pytest.fixture(scope="module")
def prompts():
    return research.heldout_prompts(5, 40, seed=7)


def test_ladder_and_confidence_stop_take_the_same_steps_on_both_paths(engine, prompts):
    schedule = DraftSchedule(3, ladder=((2, 3), (8, 2)), confidence_stop=float(np.log(0.8)))
    ref = greedy_generate(engine, prompts, 40)
    runs = [speculative_generate(engine, prompts, 40, schedule, fused=f) for f in (False, True)]
    assert runs[0].tokens == runs[1].tokens == ref
    assert runs[0].steps == runs[1].steps
    compiled = engine.programs.compilations
    again = [speculative_generate(engine, prompts, 40, schedule, fused=f) for f in (False, True)]
    assert engine.programs.compilations == compiled, "a warmed-up schedule compiles nothing"
    assert [r.steps for r in again] == [r.steps for r in runs]
    steps = runs[1].steps
    assert all(max(s.ks) - 1 <= schedule.drafts_at(len(s.seqs)) for s in steps)
    assert any(len(s.seqs) <= 2 and max(s.ks) == 4 for s in steps), "the ladder widens as sequences finish"
    assert any(len(s.seqs) > 2 for s in steps) and any(a > 0 for s in steps for a in s.accepted)
    assert any(len(d) < schedule.drafts_at(len(s.seqs)) for s in steps for d in s.drafts), "the stop cuts"
    assert all(c >= schedule.confidence_stop for s in steps for cs in s.confidences for c in cs)


@pytest.mark.parametrize("fused", [False, True])
def test_progress_counts_every_emitted_token(engine, prompts, fused):
    seen: list[int] = []
    speculative_generate(engine, prompts[:2], 17, DraftSchedule(3), fused=fused, progress=seen.append)
    assert seen[0] == 2 and seen[-1] == 2 * 17 and seen == sorted(seen)
    seen = []
    greedy_generate(engine, prompts[:2], 5, progress=seen.append)
    assert seen == [2, 4, 6, 8, 10]


def test_the_stash_holds_the_accepted_rows_hidden(engine, prompts):
    """Regression: a stash of another verify row's hidden keeps speculative == greedy (the verify's
    argmax decides every token) and only lowers acceptance, so it survived every other test. After
    a verify with one draft accepted and its verdict, the stash holds the hidden a plain decode of
    the same committed tokens leaves (within the diff oracle's bound; another row's is O(1) off).
    tests/test_mutants.py checks that this test fails under that bug."""
    assert stash_error(engine, prompts[0]) <= ORACLE_RTOL


#: `small`'s acceptance by draft position on its held-out prompts as its training record measured it
#: (presets_data/small/training.json: 32 prompts x 96 bytes, 48 new tokens, 3 flat drafts, width 8).
with open(os.path.join(SMALL_DIR, "training.json")) as _f:
    SMALL_ACCEPTANCE = json.load(_f)["engine_acceptance"]["by_position"]
#: The margin: XLA CPU is deterministic here, so the measured value recurs exactly; another
#: backend's rounding may flip a few of the ~1,000 drafts' argmaxes. A drafter fed the wrong
#: context keeps greedy equality and shows only here, far below the margin.
ACCEPTANCE_MARGIN = 0.02


@pytest.mark.parametrize("fused", [True, False])
def test_acceptance_on_the_heldout_prompts_stays_at_the_measured_value(fused):
    """Every draft position: a chained draft fed the wrong hidden (the trunk's, or a stale one)
    keeps greedy equality and shows only in the later positions."""
    study = research.study_for("small")
    prompts = research.heldout_prompts(count=32, length=96, seed=1)
    run = study.run(prompts, 48, research.flat_schedule(3), width=8, fused=fused)
    np.testing.assert_allclose(run.acceptance_by_position(), SMALL_ACCEPTANCE, atol=ACCEPTANCE_MARGIN)
