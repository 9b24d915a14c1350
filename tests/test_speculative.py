"""Speculative generation on the shipped `small` preset (a trained MTP head, so drafts are
accepted and widths shrink at different steps): the fused and the composed step paths take the
same steps under a K ladder and a confidence stop, emit plain greedy's tokens and compile nothing
once warmed up; `progress` counts every emitted token. Shares `research.study_for("small")`'s
engine with test_research."""

import numpy as np
import pytest

from metrale_jax import research
from metrale_jax.engine.speculative import DraftSchedule, greedy_generate, speculative_generate


@pytest.fixture(scope="module")
def engine():
    return research.study_for("small").engine


@pytest.fixture(scope="module")
def prompts():
    return research.heldout_prompts(5, 40, seed=7)


def test_ladder_and_confidence_stop_take_the_same_steps_on_both_paths(engine, prompts):
    schedule = DraftSchedule(3, ladder=((2, 3), (8, 1)), confidence_stop=float(np.log(0.2)))
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
