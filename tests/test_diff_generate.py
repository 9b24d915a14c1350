"""`metrale-jax diff --generate`: the scheduler (composed and fused, K ladder, confidence stop) against
greedy decoding PASSes on tiny with and without a stop, its control (one draft changed) fires, and
the planted scheduler mutant (a stop that keeps the first draft below it) FAILs it."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import settings
from diff_mutants import planted_coverage

from metrale_jax.diff import DiffRequest, Variant, render_summary, run_diff
from metrale_jax.diff.generate import CONFIDENCE_ULPS, _first_step_difference
from metrale_jax.engine.engine import Engine
from metrale_jax.engine.speculative import StepRecord

XLA_REPEAT = [Variant("xla-repeat", "xla")]
#: Between tiny's draft confidences (about -3.6 .. -2.9), so the stop cuts some drafts, not all.
STOP = -3.2


@pytest.fixture(scope="module")
def engine(tiny):
    cfg, params = tiny
    return Engine(cfg, params, settings(max_batch_size=4, max_seq_len=96, speculative=True, num_drafts=3))


@pytest.mark.parametrize("stop", [None, STOP])
def test_generate_passes_with_its_control_firing(engine, stop):
    report = run_diff(engine, DiffRequest(steps=12, generate=True, confidence_stop=stop), XLA_REPEAT)
    assert report["verdict"] == "PASS", report["reasons"]
    g = report["generate"]
    assert g["first_difference"] is None and all(g["tokens_equal_greedy"].values())
    assert g["confidence_bound_ulp"] == CONFIDENCE_ULPS and 0 <= g["confidence_max_ulp"] <= CONFIDENCE_ULPS
    assert g["detection_control"]["first_difference"] is not None
    assert (g["drafts_cut"] > 0) == (stop is not None)
    assert "control: one draft changed: fired" in render_summary(report)


def test_a_stop_that_keeps_one_draft_below_fails_generate(engine):
    with planted_coverage(engine, "stop-keeps-one-below"):
        report = run_diff(engine, DiffRequest(steps=12, generate=True, confidence_stop=STOP), XLA_REPEAT)
    assert report["verdict"] == "FAIL"
    assert any("below the confidence stop" in r for r in report["reasons"]), report["reasons"]


def test_confidences_differ_only_past_the_bound_and_drafts_always():
    """Confidences compared in float32 ulps against the bound; K, accepts and drafts exactly."""
    c = -3.0856068
    step = lambda conf, drafts=(5, 6): [StepRecord([0], [3], [1], [list(drafts)], [[-2.5, conf]])]  # noqa: E731
    two_ulp = float(np.nextafter(np.nextafter(np.float32(c), np.float32(0)), np.float32(0)))
    assert _first_step_difference(step(c), step(two_ulp), bound_ulp=2) is None
    assert _first_step_difference(step(c), step(two_ulp), bound_ulp=1)["field"] == "confidences"
    assert _first_step_difference(step(c), step(c, drafts=(5, 7)), bound_ulp=99)["field"] == "drafts"
