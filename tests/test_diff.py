"""`metrale-jax diff`: the host-side rules' unit cases, the comparison, the request checks, every mode on
the embedded model and on a fixture checkpoint, detection power against planted bugs, and the
command's exit codes.

Engines are module-scoped (compilation dominates on a 2-core CPU); every diff frees what it
allocates, so they share one engine. Variants are `xla-repeat` (run-to-run determinism), `fused`
(the fused speculative step in lock-step with the composed one; the verify modes only), `oracle`
(the committed tokens through the plain path; the verify modes and --swap) and, in the detection
tests, the planted-bug forwards of `diff_mutants` (the shared-code mutants: tests/test_mutants.py).
"""

from __future__ import annotations

import io
import json
import os
import re
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import FIXTURES, settings
from diff_mutants import MutantEngine, fused_mutant_variants, mutant_variants

from metrale_jax.diff import (
    BIT_IDENTICAL,
    Bar,
    DiffRequest,
    DiffRequestError,
    Variant,
    bounded,
    render_summary,
    run_diff,
    to_json,
)
from metrale_jax.diff import variants as variants_mod
from metrale_jax.diff.compare import Part, Recording, compare, median_after_first, without_rows
from metrale_jax.diff.prompts import batch_prompts, prompt_of_len, prompts
from metrale_jax.diff.schedule import (
    accept_coverage,
    batch_shapes,
    capped,
    control_row,
    dedup_consecutive,
    offsets,
    slot_of,
    step_drafts,
)
from metrale_jax.engine.capacity import pool_counts
from metrale_jax.engine.speculative import accepted_drafts as accepted
from metrale_jax.presets import resolve_checkpoint
from metrale_jax_cli import diff_cmd

XLA_REPEAT = [Variant("xla-repeat", "xla")]
FUSED = [Variant("fused", "xla", step="fused")]
ORACLE = variants_mod.default_variants(["oracle"])[0]
FUSED_MUTANT = fused_mutant_variants()
MOE = os.path.join(FIXTURES, "hf", "qwen3_next_moe")


# ---------------------------------------------------------------- the host-side rules' unit cases


def test_shapes_cover_every_width_then_one_ragged_mix():
    assert batch_shapes(2, [4]) == [[4, 4]]
    assert batch_shapes(7, [2, 4, 3]) == [[4] * 7, [3] * 7, [2] * 7, [4, 4, 4, 3, 3, 2, 2]]
    assert len(batch_shapes(2, [2, 3, 4])) == 3, "too few sequences to mix"
    assert batch_shapes(4, [4, 3, 2])[-1] == [4, 4, 3, 2]


def test_each_k_is_capped_by_its_slots_verify_capacity(tiny):
    counts = pool_counts(settings(max_batch_size=12, speculative=True, num_drafts=3), tiny[0])
    assert [counts.slot_draft_capacity(s) for s in (0, 7, 8, 11)] == [3, 3, 1, 1]
    assert [slot_of(i, 10, True) for i in range(10)] == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]
    cap = lambda i: counts.slot_draft_capacity(slot_of(i, 10, True)) + 1  # noqa: E731
    assert capped([4] * 10, cap) == [4] * 7 + [2] * 3
    assert capped([4] * 10, lambda i: counts.slot_draft_capacity(slot_of(i, 10, False)) + 1) == [4] * 8 + [2] * 2
    assert dedup_consecutive([[2, 2], [2, 2], [3, 2], [2, 2]]) == [[2, 2], [3, 2], [2, 2]]
    assert offsets([4, 3, 2]) == [0, 4, 7, 9]


def test_accepted_counts_leading_drafts_the_argmax_agrees_with():
    assert accepted([5, 6, 7, 8], [6, 7, 8, 1]) == 3
    assert accepted([5, 6, 7, 8], [6, 7, 9, 1]) == 2
    assert accepted([5, 6, 7, 8], [0, 7, 8, 1]) == 0
    assert accepted([5], [9]) == 0
    assert accept_coverage([[3, 1], [0, 3]], [4, 4]) == (2, 2)


def test_drafts_follow_the_continuation_with_one_corrupted_on_odd_steps():
    greedy = [10, 11, 12, 13, 14, 15]
    assert step_drafts(greedy, 1, 0, 4, 16) == [12, 13, 14]
    assert step_drafts(greedy, 1, 1, 4, 16) == [12, 14, 14]  # draft 1 + 1 mod 3 = 2
    assert step_drafts(greedy, 1, 3, 4, 16) == [13, 13, 14]  # draft 1 + 3 mod 3 = 1
    assert step_drafts(greedy, 4, 0, 4, 16) == [15, 0, 0]  # past the continuation: 0
    assert step_drafts(greedy, 4, 1, 2, 16) == [0]  # 15 + 1 wraps to 0
    assert step_drafts(greedy, 0, 1, 1, 16) == []


def test_control_row_skips_rows_left_out():
    assert control_row(4, []) == 2
    assert control_row(4, [2, 3]) == 0
    assert control_row(2, [0, 1]) == 1


def test_prompts_are_fixed_lcg_streams():
    p = prompts(2, 256)
    assert [len(x) for x in p] == [23, 64] and p[0][:6] == [110, 103, 150, 145, 116, 153]
    b = batch_prompts(4, 160)
    assert [len(x) for x in b] == [12, 19, 26, 33] and b[0][:6] == [68, 85, 76, 76, 76, 72]
    assert all(64 <= t < 96 for x in b for t in x)
    assert prompt_of_len(5, 256) == [132, 139, 126, 122, 89] and prompts(2, 256) == p


# ---------------------------------------------------------------- the comparison


def _run(*steps, prefill=None):
    pre = [Part("logits", np.zeros((1, 4), np.float32) if prefill is None else prefill, "logits")]
    return Recording(pre, [[Part("logits", np.asarray(s, np.float32), "logits")] for s in steps])


def test_compare_locates_the_first_difference_with_hex_and_ulp():
    a = _run([[1.0, 2.0, 3.0]], [[1.0, 2.0, 3.0], [0.5, 0.25, 0.0]])
    b = _run([[1.0, 2.0, 3.0]], [[1.0, 2.0, 3.0], [0.5, np.nextafter(np.float32(0.25), np.float32(1)), 0.0]])
    c = compare("v", a, b, BIT_IDENTICAL)
    assert (c.ok, c.prefill_equal, c.mismatched_steps, c.first_mismatch, c.violating_steps) == (False, True, 1, 1, [1])
    d = c.first_diff
    assert (d["step"], d["part"], d["row"], d["index"], d["ulp"]) == (1, "logits", 1, 1, 1)
    assert (d["reference_hex"], d["replay_hex"]) == ("0x3e800000", "0x3e800001") and d["argmax_equal"]
    assert compare("v", a, a, BIT_IDENTICAL).ok


def test_a_bounded_contract_fails_past_its_bound_or_on_an_argmax_change():
    a = _run([[1.0, 2.0, 3.0]])
    near = _run([[1.0, 2.0, 3.0 + 1e-5]])
    flipped = _run([[1.0, 3.0, 2.999]])
    far = _run([[1.0, 2.5, 3.0]])
    loose = bounded(1e-3, "test")
    ok = compare("v", a, near, loose)
    assert ok.ok and ok.mismatched_steps == 1 and not compare("v", a, near, BIT_IDENTICAL).ok
    assert compare("v", a, flipped, bounded(1.0, "test")).first_violation["why"] == "argmax differs"
    assert "|Δ| >" in compare("v", a, far, loose).first_violation["why"]
    short = Recording(a.prefill, [])
    assert not compare("v", a, short, loose).ok, "a missing step breaks every contract"


def test_rows_left_out_and_timing_medians():
    r = _run([[1.0, 2.0], [3.0, 4.0]], prefill=np.ones((2, 2), np.float32))
    assert without_rows(r, [0]).steps[0][0].data.tolist() == [[3.0, 4.0]]
    assert median_after_first([99.0, 1.0, 3.0, 2.0]) == 2.0 and median_after_first([5.0]) is None


# ---------------------------------------------------------------- requests


@pytest.mark.parametrize(
    "request_, message",
    [
        (DiffRequest(steps=4, batch=(2,), verify=(2,)), "--batch and --verify are separate diffs"),
        (DiffRequest(steps=1), "--steps must be at least 2"),
        (DiffRequest(steps=4, mtp=True), "--mtp runs the drafter"),
        (DiffRequest(steps=4, verify_batch=(1,), verify_batch_ks=(2,)), "a batch is at least 2"),
        (DiffRequest(steps=4, verify=(5,)), "K must be in 2..4"),
        (DiffRequest(steps=4, verify_batch=(2,)), "need each other"),
        (DiffRequest(steps=4, prefill_chunk=(8,)), "--prefill-chunk needs --prefill"),
        (DiffRequest(steps=3, swap=True), "--swap needs at least 4 steps"),
        (DiffRequest(steps=4, verify=(2,), fragment_slots=True), "--fragment-slots applies"),
    ],
)
def test_bad_requests_are_refused_with_one_line(request_, message):
    with pytest.raises(DiffRequestError, match=message):
        request_.check()


def _stub_engine(**settings_):
    base = dict(speculative=True, num_drafts=3, max_batch_size=8, max_seq_len=128)
    return SimpleNamespace(settings=SimpleNamespace(**{**base, **settings_}), drafter=True)


@pytest.mark.parametrize(
    "request_, engine, message",
    [
        (
            DiffRequest(steps=4, verify_batch=(4,), verify_batch_ks=(2,), fragment_slots=True),
            _stub_engine(max_batch_size=4),
            "holds 5 sequences at once: it needs --max-batch-size >= 5 (got 4)",
        ),
        (DiffRequest(steps=40, verify=(4,)), _stub_engine(), "it needs --max-seq-len >= 189 (got 128)"),
        (
            DiffRequest(steps=4, verify=(2,), mtp=True),
            SimpleNamespace(**{**vars(_stub_engine()), "drafter": False}),
            "--mtp needs a checkpoint with an MTP layer",
        ),
        (
            DiffRequest(steps=4, verify_batch=(2,), verify_batch_ks=(3,)),
            _stub_engine(num_drafts=1),
            "--verify-batch-ks 3 needs --num-drafts >= 2 (got 1)",
        ),
    ],
)
def test_requests_an_engine_cannot_serve_are_refused(request_, engine, message):
    with pytest.raises(DiffRequestError, match=re.escape(message)):
        request_.check_engine(engine)


# ---------------------------------------------------------------- every mode, two checkpoints


@pytest.fixture(scope="module")
def tiny_engine(tiny):
    cfg, params = tiny
    return MutantEngine(cfg, params, settings(max_batch_size=8, max_seq_len=128, speculative=True, num_drafts=3))


@pytest.fixture(scope="module")
def moe_engine():
    cfg, params = resolve_checkpoint(MOE)
    return MutantEngine(
        cfg, params, settings(max_batch_size=8, max_seq_len=128, speculative=True, num_drafts=3, kv_cache_dtype="fp8")
    )


MODES = {
    "default": DiffRequest(steps=3, prompts=2),
    "batch": DiffRequest(steps=3, batch=(3,), fragment_slots=True),
    "verify": DiffRequest(steps=4, verify=(2, 4), mtp=True),
    "verify-batch": DiffRequest(steps=4, verify_batch=(3,), verify_batch_ks=(4, 2), mtp=True, fragment_slots=True),
    "prefill": DiffRequest(steps=2, prefill=(20, 37), prefill_chunk=(8,)),
    "swap": DiffRequest(steps=4, swap=True),
}


def _controls(report):
    """Every detection control of a report, as (label, fired)."""
    if report["mode"] == "swap":
        return [(c["variant"], c["saw_difference_after"]) for c in report["controls"]]
    sections = report.get("widths") or report.get("shapes") or report.get("verify") or []
    controls = [s["detection_control"] for s in sections] + [report.get("detection_control")]
    controls += [s.get(f"{v}_detection_control") for s in sections for v in ("fused", "oracle")]
    controls += [report.get("oracle_detection_control")]
    return [(c["variant"], c["mismatched_steps"] > 0 or not c["prefill_equal"]) for c in controls if c]


@pytest.mark.parametrize("checkpoint", ["tiny_engine", "moe_engine"])
@pytest.mark.parametrize("mode", list(MODES))
def test_each_mode_passes_with_a_control_that_fires(request, checkpoint, mode):
    engine = request.getfixturevalue(checkpoint)
    report = run_diff(engine, MODES[mode], XLA_REPEAT + FUSED + ORACLE)
    assert report["mode"] == mode
    assert report["verdict"] == "PASS", report["reasons"]
    assert _controls(report) and all(fired for _, fired in _controls(report))
    fused, oracle = ({v["name"]: v for v in report["variants"]}[x] for x in ("fused", "oracle"))
    assert oracle["available"] == (mode.startswith("verify") or mode == "swap"), oracle
    if mode.startswith("verify"):
        sections = report.get("shapes") or report["verify"]
        assert all(
            c["ok"] and c["argmax_equal"] for s in sections for c in s["comparisons"] if c["variant"] == "oracle"
        )
        assert sections[0]["oracle_detection_control"]["fired"] and not sections[0]["oracle_detection_control"]["ok"]
    if mode == "swap":
        assert report["oracle"]["ok"] and report["oracle"]["mismatched_steps"] == 0
    if mode.startswith("verify"):
        sections = report.get("shapes") or report["verify"]
        assert all(s["fused_detection_control"] for s in sections)
        assert all(c["ok"] and c["steps"] for s in sections for c in s["comparisons"] if c["variant"] == "fused")
    else:
        assert not fused["available"] and "--verify" in fused["reason"]
    assert engine.blocks.slots.live == 0 and engine.forward == "xla"
    json.loads(to_json(report))
    assert "verdict: PASS" in render_summary(report)
    if mode == "verify-batch":
        assert [s["ks"] for s in report["shapes"]] == [[4, 4, 4], [2, 2, 2], [4, 4, 2]]
        assert all(s["full_accepts"] and s["partial_accepts"] for s in report["shapes"])
        assert report["drafter_warmup"] == [{"rows": 3, "first_proposes_equal": True, "discarded_run": False}]
    if mode == "prefill":
        chunked = [c for s in report["lengths"] for c in s["comparisons"] if c["path"] == "chunk 8"]
        assert chunked and all(c["contract"].startswith("bounded") for c in chunked)
    if mode == "swap":
        assert report["moves"][0]["slot"][0] != report["moves"][0]["slot"][1], "the restore lands on another slot"


# ---------------------------------------------------------------- detection power


def test_planted_state_bugs_each_fail_naming_their_step(tiny_engine):
    """Each planted bug (replay forward only) FAILs, first at the step its bug first shows:
    the step after the first partial accept for the verdict bugs, the first propose for the
    drafter's, step 0 for the slot mix-up."""
    report = run_diff(
        tiny_engine,
        DiffRequest(steps=4, verify_batch=(3,), verify_batch_ks=(4,), mtp=True),
        XLA_REPEAT + mutant_variants(),
    )
    shape = report["shapes"][0]
    first_partial = min(s for s, acc in enumerate(shape["accepted"]) if any(a < 3 for a in acc))
    expected = {
        "mutant-fold-row": (1, "verify logits"),
        "mutant-conv-kept": (first_partial + 1, "verify logits"),
        "mutant-commit-off-by-one": (first_partial + 1, "verify logits"),
        "mutant-rejected-kv": (first_partial, "draft 1 logits"),
        "mutant-wrong-slot": (0, "verify logits"),
        "mutant-prenorm-hidden": (0, "draft 1 logits"),
    }
    got = {c["variant"].split()[0]: c for c in shape["comparisons"]}
    assert got.pop("xla-repeat")["ok"]
    assert report["verdict"] == "FAIL" and set(got) == set(expected)
    for name, c in got.items():
        where = c["first_violation"]
        assert not c["ok"] and (where["step"], where["part"]) == expected[name], name
        assert any(
            r.startswith(f"verify-batch n=3 ks=[4, 4, 4], {name}") and f"first at step {expected[name][0]}," in r
            for r in report["reasons"]
        ), name


def test_the_fused_lockstep_compares_every_pool_leaf(tiny_engine):
    """A fused step that also writes junk no output reads (the padding dummy's stash row) FAILs
    at step 0 on that pool leaf, while its logits, drafts and confidences stay equal."""
    report = run_diff(
        tiny_engine, DiffRequest(steps=3, verify_batch=(2,), verify_batch_ks=(4,), mtp=True), FUSED_MUTANT
    )
    (c,) = report["shapes"][0]["comparisons"]
    assert not c["ok"] and report["verdict"] == "FAIL"
    assert (c["first_violation"]["step"], c["first_violation"]["part"]) == (0, "pool stash")
    assert c["mismatched_steps"] == c["steps"] == 3


# ---------------------------------------------------------------- the command


def _cli(*args):
    return CliRunner().invoke(diff_cmd.diff, ["--checkpoint", "tiny", "--out", "unused.json", *args])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "4", "--batch", "2", "--swap"], "--batch and --swap are separate diffs"),
        (["--steps", "4", "--mtp"], "--mtp runs the drafter"),
        (["--steps", "4", "--verify-batch", "1", "--verify-batch-ks", "2"], "a batch is at least 2"),
        (["--steps", "4", "--verify", "5"], "K must be in 2..4"),
        (["--steps", "4", "--batch", "2,x"], "--batch takes comma-separated integers"),
        (["--steps", "4", "--verify", "4", "--speculative"], "--verify 4 needs --num-drafts >= 3 (got 1)"),
        (["--steps", "4", "--verify", "2"], "--verify verifies drafts: it needs --speculative"),
        (["--steps", "4", "--forwards", "cuda"], "--forwards: unknown cuda"),
        (["--steps", "4", "--checkpoint", "/nonexistent/dir"], "neither a preset"),
    ],
)
def test_bad_flags_exit_2_with_one_clear_line(args, message):
    result = _cli(*args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr


def test_a_checkpoint_that_does_not_load_exits_2(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    result = _cli("--steps", "4", "--checkpoint", str(tmp_path))
    assert result.exit_code == 2 and result.stderr.startswith("error: unsupported model_type 'llama'")


def test_the_command_writes_the_report_and_prints_the_summary(tmp_path):
    out = tmp_path / "sub" / "report.json"
    args = ["--checkpoint", "tiny", "--steps", "2", "--prefill", "20", "--forwards", "xla-repeat", "--out", str(out)]
    result = CliRunner().invoke(diff_cmd.diff, args)
    assert result.exit_code == 0, result.output
    assert "verdict: PASS" in result.stdout and "prefill L=20" in result.stdout
    report = json.loads(out.read_text())
    assert report["verdict"] == "PASS" and report["checkpoint"] == "tiny"
    sized = {s["setting"]: s for s in report["provenance"]["settings"]}["--max-seq-len"]
    assert sized["rule"] == diff_cmd.SIZED_RULE and int(sized["effective"]) >= 22


@pytest.mark.parametrize("as_json", [False, True])
def test_a_failing_diff_exits_1(tmp_path, monkeypatch, as_json):
    failing = {
        "mode": "prefill",
        "graphs": "jit",
        "steps": 2,
        "variants": [],
        "lengths": [],
        "verdict": "FAIL",
        "reasons": ["planted"],
        "wall_s": 0.0,
    }
    monkeypatch.setattr(diff_cmd, "run_diff", lambda *a, **k: dict(failing))
    result = CliRunner().invoke(
        diff_cmd.diff,
        ["--checkpoint", "tiny", "--steps", "2", "--prefill", "8", "--out", str(tmp_path / "r.json")]
        + ["--json"] * as_json,
    )
    assert result.exit_code == 1
    if as_json:
        assert json.loads(result.stdout)["reasons"] == ["planted"]
    else:
        assert "verdict: FAIL" in result.stdout and "- planted" in result.stdout


def test_a_forward_that_cannot_be_built_is_reported_unavailable(monkeypatch):
    real = variants_mod.make_ops

    def make_ops(name):
        if name == "pallas":
            raise ImportError("no kernels here")
        return real(name)

    monkeypatch.setattr(variants_mod, "make_ops", make_ops)
    found, unavailable = variants_mod.default_variants()
    assert [(v.label, v.step) for v in found] == [("xla-repeat", "composed"), ("fused", "fused"), ("oracle", "oracle")]
    assert unavailable == [{"name": "pallas", "reason": "ImportError: no kernels here"}]


def test_the_progress_bar_draws_only_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream, drawn in [(io.StringIO(), False), (Terminal(), True)]:
        bar = Bar(stream)
        bar.section("verify-batch n=4", 4)
        bar.advance(4)
        bar.close()
        assert ("[########################] 4/4" in stream.getvalue()) == drawn
