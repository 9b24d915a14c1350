"""The benchmark harness (`python -m benchmarks`) in its `--smoke` mode: every section
runs end to end at tiny sizes with one repeat, the tables and the JSON come out, and the
benchmark's own verify-loop driver compiles nothing after its warm-up (scan and unrolled).

The smoke run is the real entry point in a subprocess, with XLA's CPU backend optimisations off
(its timings mean nothing; it compiles faster). Nothing here asserts on wall time.
The HF side runs only when its venv already exists (smoke never creates it); otherwise the
section must say it was skipped and why.
"""

import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import cli, hf_env, models, report, roofline  # noqa: E402
from benchmarks.timing import Stats, back_to_back, paired  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    path = d / "bench.json"
    env = dict(os.environ, XLA_FLAGS=FAST_COMPILE, JAX_PLATFORMS="cpu")
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--smoke", "--json", str(path), "--workdir", str(d)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return {"table": r.stdout}, json.loads(path.read_text())


def test_smoke_prints_every_table_and_writes_the_json(smoke):
    res, saved = smoke
    assert (
        list(saved["sections"]) == ["hf", "compile", "forwards", "gap", "slots", "roofline"] and saved["failed"] == []
    )
    for title in (
        "machine:",
        "HF transformers",
        "== Compile cost",
        "== Forwards",
        "== Idle gap",
        "== Slots",
        "== Roofline (DRY RUN",
    ):
        assert title in res["table"]
    assert saved["machine"]["load_average_1_5_15"] and saved["machine"]["cpu_count"] >= 1
    assert set(saved["load"]) == set(saved["sections"])


def test_hf_section_compares_the_same_weights_or_says_why_it_was_skipped(smoke):
    _, saved = smoke
    hf = saved["sections"]["hf"]
    if "skipped" in hf:
        assert "venv" in hf["skipped"]
        assert hf_env.ensure_hf_venv(create=False)[0] is None
        return
    assert [c["kind"] for c in hf["cases"]] == ["prefill", "decode", "verify"]
    for c in hf["cases"]:
        assert c["max_abs_diff"] <= 1e-4 * c["max_abs_logit"], c  # both sides run the same float32 weights
        assert math.isfinite(c["ratio_of_medians"]) and c["ratio_of_medians"] > 0
        assert c["jax"]["n"] == c["hf"]["n"] == 1 and c["jax_device_s"] > 0
        assert c["jax_b2b"]["n"] == c["hf_b2b"]["n"] == hf["block"] == 2 and c["hf_over_jax_b2b"] > 0


def test_gap_section_times_every_gap_in_every_round(smoke):
    _, saved = smoke
    gap = saved["sections"]["gap"]
    assert [g["gap_s"] for g in gap["gaps"]] == [0.0, 0.001]
    for g in gap["gaps"]:
        assert len(g["round_medians_s"]) == gap["rounds"] == 1 and g["best_median_s"] == min(g["round_medians_s"]) > 0


def test_slots_section_times_both_steps_at_every_slot_count(smoke):
    """The section runs at each slot count (not timed here), and its programs copy no pool leaf."""
    _, saved = smoke
    sec = saved["sections"]["slots"]
    assert [r["slots"] for r in sec["rows"]] == [2, 8]
    for r in sec["rows"]:
        assert r["decode_s"] > 0 and r["verify_s"] > 0 and r["gdn_state_bytes"] > 0
        assert set(r["pool_copies"]) >= {"prefill_chunk", "step_rows"} and sum(r["pool_copies"].values()) == 0


def test_verify_loop_driver_compiles_nothing_after_warmup(smoke):
    """The benchmark's own ragged verify loop: every program compiles in its first step, and
    neither the engine nor JAX's backend compiles anything in the steps after warm-up."""
    _, saved = smoke
    cases = saved["sections"]["compile"]["cases"]
    assert sorted(c["layout"] for c in cases) == ["scan", "unrolled"]
    for c in cases:
        assert c["groups"] == 2
        for run in c["runs"]:
            assert run["recompiles_after_warmup"] == 0
            assert run["backend_compiles_after_warmup"] == 0
            assert run["compilations_after_first_step"] == run["compilations"]
            assert {p["name"] for p in run["programs"]} == {
                "prefill_chunk",
                "propose",
                "step_rows",
                "stash_rows",
                "gdn_fold",
                "commit_conv",
            }


def test_forwards_agree_and_the_roofline_dry_run_is_consistent(smoke):
    _, saved = smoke
    fw = saved["sections"]["forwards"]
    assert fw["interpret"] and fw["refusals"] == []
    for c in fw["cases"]:
        assert c["max_abs_diff"] <= 1e-4 and c["ratio_of_medians"] > 0
    rl = saved["sections"]["roofline"]
    assert rl["dry_run"] and rl["refusals"] == []
    for s in rl["steps"]:
        assert 0 < s["floor_must_ms"] <= s["floor_impl_ms"]
        assert s["device_ms"] > 0 and s["engine_ms"] > 0
        assert [k["kernel"] for k in s["kernels"]] == ["gdn_rows", "attention"] and all(k["ok"] for k in s["kernels"])


def test_step_bytes_of_the_real_qwen35_stack():
    """The roofline's accounting at Qwen3.5-35B-A3B width (no arrays are built)."""
    cfg = models.qwen35_stack(4)
    st = models.settings(max_batch_size=8, max_seq_len=4096, speculative=True, num_drafts=3, kv_cache_dtype="bf16")
    one = roofline.step_bytes(cfg, st, n=1, t=1, ctx=1000, verify=False, drafter=False, weight_bytes=2)
    expert = 3 * 2048 * 512 * 2  # gate, up, down of one expert, bf16
    assert one["experts_hit_per_layer"] == pytest.approx(8)
    assert one["weights_impl"] - one["weights_must"] == pytest.approx(4 * (256 - 8) * expert)
    assert one["kv"] == 1 * 1 * (1001 + 1) * 2 * 256 * 2 * 2  # one attention layer: ctx + 1 keys read, 1 written
    assert one["state"] == 3 * (2 * 32 * 128 * 128 * 4 + 2 * 8192 * 4 * 2)
    ver = roofline.step_bytes(cfg, st, n=8, t=4, ctx=1000, verify=True, drafter=True, weight_bytes=2)
    assert one["weights_must"] < ver["weights_must"] < ver["weights_impl"]
    assert ver["logits"] == 32 * 248320 * 4


def test_hf_section_is_skipped_with_a_reason_when_its_venv_is_absent(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_VENV", str(tmp_path / "no-venv"))
    out = cli._section("hf", cli._resolve(cli.parse(["--smoke", "--no-hf-setup"])))
    assert "not ready" in out["skipped"] and "make_hf_fixtures.sh" in out["skipped"]


def test_gpu_mode_needs_a_gpu_or_a_dry_run(capsys):
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit):
        cli.run(["--gpu"])
    assert "--gpu --dry-run" in capsys.readouterr().err


def test_paired_alternates_and_reports_per_round_ratios():
    order = []
    a = lambda: order.append("a") or 2.0  # noqa: E731
    b = lambda: order.append("b") or 1.0  # noqa: E731
    sa, sb, r = paired(a, b, repeats=3, warmup=1)
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert (sa.median, sb.median, r.median, r.spread) == (2.0, 1.0, 2.0, 0.0)
    assert Stats.of([3.0, 1.0, 2.0]).median == 2.0


def test_back_to_back_alternates_blocks_and_takes_ratios_of_block_medians():
    order = []

    def block(side, secs):
        return lambda: [order.append(side) or s for s in secs]

    sa, sb, r = back_to_back(block("a", [4.0, 2.0, 2.0]), block("b", [1.0, 1.0, 3.0]), rounds=2)
    assert order == ["a"] * 3 + ["b"] * 3 + ["b"] * 3 + ["a"] * 3
    assert (sa.n, sa.median, sb.median) == (6, 2.0, 1.0)
    assert (r.n, r.median, r.spread) == (2, 2.0, 0.0)


def test_benchmark_checkpoint_is_rewritten_when_the_weights_change(tmp_path):
    """The HF side must read the engine's weights: a checkpoint written from other weights of the
    same config (an older parameter tree, another seed) is not reused."""
    from metrale_jax.checkpoint import load_checkpoint

    write_checkpoint = models.write_checkpoint
    cfg, a = models.model("tiny-2L")
    b = jax.tree_util.tree_map(lambda x: x + 1.0, a)
    for params in (a, b, a):
        write_checkpoint(str(tmp_path), cfg, params)
        _, loaded = load_checkpoint(str(tmp_path))
        for x, y in zip(jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(params)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    stamp = (tmp_path / "weights.sha256").stat().st_mtime_ns
    write_checkpoint(str(tmp_path), cfg, a)  # same weights: reused, not rewritten
    assert (tmp_path / "weights.sha256").stat().st_mtime_ns == stamp


def test_hf_table_marks_cases_whose_logits_differ():
    stats = {"n": 1, "median": 1e-3, "min": 1e-3, "max": 1e-3, "p25": 1e-3, "p75": 1e-3}
    timings = dict.fromkeys(("jax", "hf", "ratio", "jax_b2b", "hf_b2b", "ratio_b2b"), stats)
    ratios = dict.fromkeys(("ratio_of_medians", "hf_over_jax", "hf_over_jax_b2b"), 1.0)
    case = dict(kind="verify", n=1, t=2, **timings, jax_first_s=1.0, jax_device_s=1e-3, max_abs_logit=5.0, **ratios)
    hf = {"transformers": "5", "torch": "2", "attn_implementation": "sdpa", "experts_implementation": "x", "threads": 1}
    run = {
        "model": "tiny",
        "context_tokens": 128,
        "repeats": 1,
        "warmup": 0,
        "block": 1,
        "hf": hf,
        "cases": [dict(case, max_abs_diff=2e-5), dict(case, max_abs_diff=4.2)],
    }
    rows = [line for line in report.hf_table(run).text().splitlines() if line.startswith("verify")]
    assert len(rows) == 2 and "LOGITS DIFFER" not in rows[0] and "LOGITS DIFFER" in rows[1]


def test_notes_replace_only_the_results_section_and_need_both_markers(tmp_path):
    notes = tmp_path / "NOTES.md"
    head, tail = "# Notes\n\nkept above\n", "kept below\n"
    notes.write_text(f"{head}{report.NOTES_BEGIN}\nold results\n{report.NOTES_END}\n{tail}")
    table = report.Table("Slots: a title", notes=("a note",), grids=(report.Grid(("slots", "ms"), [("8", "1.5")]),))
    report.write_notes(str(notes), report.notes_markdown("python -m benchmarks", "machine: m", [table]))
    text = notes.read_text()
    assert text.startswith(f"{head}{report.NOTES_BEGIN}\n") and text.endswith(f"{report.NOTES_END}\n{tail}")
    assert "old results" not in text and "| slots | ms |" in text and "| 8 | 1.5 |" in text and "machine: m" in text
    report.write_notes(str(notes), "new body")
    assert notes.read_text() == f"{head}{report.NOTES_BEGIN}\nnew body\n{report.NOTES_END}\n{tail}"
    bare = tmp_path / "BARE.md"
    bare.write_text("no markers\n")
    with pytest.raises(ValueError, match="bench:results:begin"):
        report.write_notes(str(bare), "x")
    assert bare.read_text() == "no markers\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["BARE.md", "NOTES.md"]  # no temporary file left


def test_default_run_times_the_realistic_width_model_at_its_own_sizes():
    """`make bench` compares with HF on tiny and on the hidden-512 Qwen3-Next, each at its own sizes."""
    s = cli._resolve(cli.parse([]))
    assert s.sections[:2] == ["hf", "hf-wide"] and "hf-wide" not in cli._resolve(cli.parse(["--smoke"])).sections
    w = s.wide()
    assert (w.model, w.prefill_lens, w.ns, w.ks, w.repeats, w.block) == (
        "qwen3-next-h512",
        [128, 512],
        [1, 8],
        [4],
        5,
        2,
    )
    assert (s.model, s.prefill_lens, s.repeats, s.block) == ("tiny", [128, 512, 2048], 7, 8)
    cfg = models.config("qwen3-next-h512")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok) == (512, 8, 8, 2)
    shapes = jax.eval_shape(lambda: models.model("qwen3-next-h512")[1])
    assert 45e6 < sum(x.size for x in jax.tree_util.tree_leaves(shapes)) < 55e6
