"""The benchmark harness (`python -m benchmarks all`) in its `--smoke` mode: every section
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
import types

import jax
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import cli, hf_env, models, report, roofline  # noqa: E402
from benchmarks.sections import hf as hf_section  # noqa: E402
from benchmarks.timing import Stats, back_to_back, paired  # noqa: E402
from metrale_jax import model_registry  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    path = d / "bench.json"
    env = dict(os.environ, XLA_FLAGS=FAST_COMPILE, JAX_PLATFORMS="cpu")
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks", "all", "--smoke", "--json", str(path), "--workdir", str(d)],
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
    assert list(saved["sections"]) == [
        "hf",
        "hf-300m",
        "e2e",
        "anatomy",
        "compile",
        "forwards",
        "gap",
        "slots",
        "multiturn",
        "invariant",
        "roofline",
    ]
    assert saved["failed"] == []
    for title in (
        "machine:",
        "HF transformers",
        "== End to end",
        "== Anatomy of a step",
        "== Compile cost",
        "== Forwards",
        "== Idle gap",
        "== Slots",
        "== Batch-invariant mode",
        "== Roofline (DRY RUN",
    ):
        assert title in res["table"]
    assert saved["machine"]["load_average_1_5_15"] and saved["machine"]["cpu_count"] >= 1
    assert set(saved["load"]) == set(saved["sections"])


@pytest.mark.parametrize("section, model_type", [("hf", "qwen3_next"), ("hf-300m", "qwen3_5_moe_text")])
def test_hf_section_compares_the_same_weights_or_says_why_it_was_skipped(smoke, section, model_type):
    """Both checkpoint layouts load in HF with the engine's weights (hf-300m's smoke stand-in is written in
    the Qwen3.5-MoE layout), and every decode and verify case carries its CPU roofline."""
    _, saved = smoke
    hf = saved["sections"][section]
    if "skipped" in hf:
        assert "venv" in hf["skipped"]
        assert hf_env.ensure_hf_venv(create=False)[0] is None
        return
    assert hf["model_type"] == model_type and hf["bandwidth_past_cache"] > 0
    assert [c["kind"] for c in hf["cases"]] == ["prefill", "decode", "verify"]
    for c in hf["cases"]:
        assert c["max_abs_diff"] <= 1e-4 * c["max_abs_logit"], c  # both sides run the same float32 weights
        assert c["rows_differ"] == 0 and c["logit_rows"] == c["n"] * (c["t"] if c["kind"] == "verify" else 1)
        assert math.isfinite(c["ratio_of_medians"]) and c["ratio_of_medians"] > 0
        assert c["jax"]["n"] == c["hf"]["n"] == 1 and c["jax_device_s"] > 0
        assert c["jax_b2b"]["n"] == c["hf_b2b"]["n"] == hf["block"] == 2 and c["hf_over_jax_b2b"] > 0
        if c["kind"] == "prefill":
            assert c["roofline"] is None
            continue
        ro = c["roofline"]
        assert ro["floor_s"] == pytest.approx(ro["bytes"]["total_must"] / ro["bandwidth_weights_sized"])
        assert ro["bytes"]["weights_must"] < ro["bytes"]["weights_all_experts"] and ro["floor_over_jax_device"] > 0


def test_e2e_section_generates_the_greedy_tokens_both_ways(smoke):
    """Every speculative variant (MTP drafts on `small`, oracle drafts on the stand-in width; fused, and
    composed at the largest draft count) emitted the greedy tokens in every call, and the rates and ratios
    were measured."""
    from benchmarks.e2e import modes_at

    _, saved = smoke
    rows = saved["sections"]["e2e"]["rows"]
    assert [(r["model"], r["drafter"], r["n"], r["drafts"], r["mode"]) for r in rows] == [
        ("small", "MTP", 1, 1, "fused"),
        ("small", "MTP", 1, 1, "composed"),
        ("tiny-2L", "oracle", 2, 2, "fused"),
        ("tiny-2L", "oracle", 2, 2, "composed"),
    ]
    assert [modes_at(d, [1, 2, 3]) for d in (1, 2, 3)] == [("fused",), ("fused",), ("fused", "composed")]
    sampled = saved["sections"]["e2e"]["sampled_rows"]
    assert [(r["sampling"], r["speculative_sampling"], r["n"], r["drafts"], r["mode"]) for r in sampled] == [
        ("T 0.7, top-p 0.9, seed 0", "gumbel", 1, 1, "fused"),
        ("T 0.7, top-p 0.9, seed 0", "rejection", 1, 1, "fused"),
    ]
    assert [r["same_tokens"] for r in sampled] == [True, None]  # rejection keeps the law, not the tokens
    for r in rows + sampled:
        assert r["same_tokens"] is not False and r["verify_steps"] > 0
        assert 1 <= r["tokens_per_verify_per_seq"] <= r["drafts"] + 1
        assert r["spec_tok_s"]["median"] > 0 and r["greedy_tok_s"]["median"] > 0 and r["ratio"]["median"] > 0
        assert len(r["acceptance_by_position"]) == r["drafts"]
        assert all(0 <= a <= 1 for a in r["acceptance_by_position"])


def test_multiturn_section_saves_prefill_tokens_and_generates_the_same_tokens(smoke):
    """With the prefix cache the conversations prefill fewer tokens than they send, the turns after
    the first restore, and both engines generate the same tokens."""
    _, saved = smoke
    mt = saved["sections"]["multiturn"]
    on, off = mt["modes"]["cached"], mt["modes"]["uncached"]
    assert mt["same_tokens"] and on["prompt_tokens"] == off["prompt_tokens"]
    assert off["prefill_tokens"] == off["prompt_tokens"] and off["hit_rate"] == 0
    assert on["prefill_tokens"] < on["prompt_tokens"] and on["hit_rate"] > 0
    assert all(t["restored"] for t in on["turns"] if t["turn"] > 0)
    assert len(on["ttft_median_s"]) == mt["turns"] and all(x > 0 for x in on["ttft_median_s"])


def test_gap_section_times_every_gap_in_every_round(smoke):
    _, saved = smoke
    gap = saved["sections"]["gap"]
    assert [g["gap_s"] for g in gap["gaps"]] == [0.0, 0.001]
    for g in gap["gaps"]:
        assert len(g["round_medians_s"]) == gap["rounds"] == 1 and g["best_median_s"] == min(g["round_medians_s"]) > 0


def test_invariant_section_times_every_step_in_both_modes(smoke):
    """Each step ran in the default mode and under --batch-invariant (their own processes), and its ratio is
    the two modes' times of the same round."""
    _, saved = smoke
    sec = saved["sections"]["invariant"]
    steps = ["decode n=1", "decode n=8", "verify n=8 K=4", f"prefill {sec['prefill_len']}"]
    assert [(r["model"], r["step"]) for r in sec["rows"]] == [("tiny", s) for s in steps]
    for r in sec["rows"]:
        assert r["default_s"] > 0 and r["invariant_s"] > 0 and len(r["round_ratios"]) == sec["rounds"] == 1
        assert r["ratio"] == pytest.approx(r["invariant_s"] / r["default_s"]), r


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
        assert 0 < s["floor_must_ms"] <= s["floor_all_experts_ms"]
        assert s["device_ms"] > 0 and s["engine_ms"] > 0
        assert [k["kernel"] for k in s["kernels"]] == ["gdn_rows", "attention"] and all(k["ok"] for k in s["kernels"])


def test_step_bytes_of_the_real_qwen35_stack():
    """The roofline's accounting at Qwen3.5-35B-A3B width (no arrays are built)."""
    cfg = model_registry.qwen35_stack(4)
    st = models.settings(max_batch_size=8, max_seq_len=4096, speculative=True, num_drafts=3, kv_cache_dtype="bf16")
    one = roofline.step_bytes(cfg, st, n=1, t=1, ctx=1000, verify=False, drafter=False, weight_bytes=2)
    expert = 3 * 2048 * 512 * 2  # gate, up, down of one expert, bf16
    assert one["experts_hit_per_layer"] == pytest.approx(8)
    assert one["weights_all_experts"] - one["weights_must"] == pytest.approx(4 * (256 - 8) * expert)
    assert one["kv"] == 1 * 1 * (1001 + 1) * 2 * 256 * 2 * 2  # one attention layer: ctx + 1 keys read, 1 written
    assert one["state"] == 3 * (2 * 32 * 128 * 128 * 4 + 2 * 8192 * 4 * 2)
    ver = roofline.step_bytes(cfg, st, n=8, t=4, ctx=1000, verify=True, drafter=True, weight_bytes=2)
    assert one["weights_must"] < ver["weights_must"] < ver["weights_all_experts"]
    assert ver["logits"] == 32 * 248320 * 4


def test_hf_section_is_skipped_with_a_reason_when_its_venv_is_absent(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_VENV", str(tmp_path / "no-venv"))
    out = cli.run_section("hf", cli.resolve(cli.parse(["--smoke", "--no-hf-setup"])))
    assert "not ready" in out["skipped"] and "make_hf_fixtures.sh" in out["skipped"]


def test_gpu_mode_needs_a_gpu_or_a_dry_run(capsys):
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit):
        cli.run(["roofline", "--gpu"])
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
    """A case's logit rows over the tolerance: none (clean), a minority (one sequence's routing near-tie,
    named as such), most (not the same model)."""
    from benchmarks.vs_hf import _diff

    hf_logits = np.linspace(-5.0, 5.0, 4 * 7).reshape(4, 7)
    jax_logits = hf_logits.copy()
    jax_logits[2, 3] += 0.5
    assert _diff(jax_logits, hf_logits) == (pytest.approx(0.5), 5.0, 1, 4)
    assert _diff(hf_logits + 1e-6, hf_logits)[2:] == (0, 4)
    stats = {"n": 1, "median": 1e-3, "min": 1e-3, "max": 1e-3, "p25": 1e-3, "p75": 1e-3}
    timings = dict.fromkeys(("jax", "hf", "ratio", "jax_b2b", "hf_b2b", "ratio_b2b"), stats)
    ratios = dict.fromkeys(("ratio_of_medians", "hf_over_jax", "hf_over_jax_b2b"), 1.0)
    case = dict(kind="verify", n=2, t=2, **timings, jax_first_s=1.0, jax_device_s=1e-3, max_abs_logit=5.0, **ratios)
    hf = {"transformers": "5", "torch": "2", "attn_implementation": "sdpa", "experts_implementation": "x", "threads": 1}
    run = {
        "model": "tiny",
        "context_tokens": 128,
        "repeats": 1,
        "warmup": 0,
        "block": 1,
        "hf": hf,
        "cases": [
            dict(case, max_abs_diff=2e-5, rows_differ=0, logit_rows=4),
            dict(case, max_abs_diff=0.5, rows_differ=1, logit_rows=4),
            dict(case, max_abs_diff=4.2, rows_differ=3, logit_rows=4),
        ],
    }
    rows = [line for line in hf_section.table(run).text().splitlines() if line.startswith("verify")]
    assert len(rows) == 3 and not any("differ" in r.lower() for r in rows[:1])
    assert "1/4 logit rows differ" in rows[1] and "LOGITS DIFFER" not in rows[1] and "LOGITS DIFFER" in rows[2]


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


def test_default_run_times_the_realistic_width_models_at_their_own_sizes():
    """`make bench` compares with HF on tiny, on the 45 M Qwen3-Next and on the ~300 M Qwen3.5-MoE, each at
    its own sizes, and runs the end-to-end section; both wide models have one MTP layer (their verify is
    speculative), the 300 M one in the Qwen3.5-MoE checkpoint layout."""
    s = cli.resolve(cli.parse([]))
    assert s.sections[:5] == ["hf", "hf-45m", "hf-300m", "hf-0.8b", "e2e"]
    assert "hf-45m" not in cli.resolve(cli.parse(["--smoke"])).sections
    sizes = {name: (w.model, w.prefill_lens, w.ns, w.ks, w.repeats, w.prefill_b2b) for name, w in s.wide.items()}
    assert sizes == {
        "hf-45m": ("qwen3-next-h512", [128, 1024, 2048], [1, 8], [4], 3, False),
        "hf-300m": ("qwen35-moe-h1024", [128], [1, 8], [4], 3, False),
        "hf-0.8b": (os.path.expanduser(hf_section.STANDIN_DIR), [256], [1, 4], [4], 3, False),
    }
    assert s.hf_section("hf-0.8b").dtype == "checkpoint" and s.hf_section("hf-300m").dtype == "float32"
    w = s.hf_section("hf-300m")
    assert (w.model, w.prefill_lens, w.repeats, w.warmup, w.block, w.ctx) == ("qwen35-moe-h1024", [128], 3, 1, 2, 128)
    assert (s.model, s.prefill_lens, s.repeats, s.block, s.prefill_b2b) == ("tiny", [128, 512, 2048], 7, 8, True)
    assert cli.resolve(cli.parse(["--wide-ns", "2"])).hf_section("hf-45m").ns == [2]
    assert (s.e2e_ns, s.e2e_drafts, s.e2e_oracle_model, s.e2e_oracle_ns, s.e2e_accept) == (
        [1, 4, 8],
        [1, 2, 3],
        "qwen3-next-h512",
        [1, 8],
        0.8,
    )
    assert (s.e2e_sample_ns, s.e2e_temperature, s.e2e_top_p) == ([1, 8], 0.7, 0.9)
    h512, h1024 = models.config("qwen3-next-h512"), models.config("qwen35-moe-h1024")
    assert (h512.hidden_size, h512.num_hidden_layers, h512.num_experts, h512.num_experts_per_tok) == (512, 8, 8, 2)
    assert 44e6 < models.parameter_count(h512.replace(num_mtp_layers=0)) < 46e6  # the 45 M checkpoint
    assert (h1024.hidden_size, h1024.num_hidden_layers, h1024.num_experts, h1024.num_experts_per_tok) == (
        1024,
        16,
        32,
        4,
    )
    assert (h1024.linear_num_key_heads, h1024.linear_num_value_heads, h1024.linear_value_head_dim) == (8, 16, 64)
    assert h1024.layer_types.count("full_attention") == 4 and h1024.vocab_size == 32768
    assert 280e6 < models.parameter_count(h1024) < 320e6 and h1024.weight_layout == "qwen3_5"
    assert h512.num_mtp_layers == h1024.num_mtp_layers == 1
    shapes = jax.eval_shape(lambda: models.model("qwen3-next-h512")[1])
    assert sum(x.size for x in jax.tree_util.tree_leaves(shapes)) == models.parameter_count(h512)


def test_e2e_runs_only_the_models_given_sizes(monkeypatch):
    """An empty list of n leaves that model out (loaded and run not at all) and runs the other one at its
    sizes; with both empty the section returns no row."""
    from benchmarks import e2e

    loaded, ran = [], []
    cfg = types.SimpleNamespace(vocab_size=16)  # what run reads of a config; _rows (replaced) reads the rest
    monkeypatch.setattr(e2e.models, "model", lambda name: (loaded.append(name), (cfg, None))[1])
    monkeypatch.setattr(e2e, "heldout_prompts", lambda count, length, seed: [[1] * length] * count)
    monkeypatch.setattr(e2e, "_rows", lambda label, cfg, params, prompts_for, ns, *rest: ran.append((label, ns)) or [])

    def run(*argv: str) -> dict:
        loaded.clear(), ran.clear()
        return e2e.run(cli.resolve(cli.parse(list(argv))))

    none = ("--e2e-sample-ns", "")
    assert run("--e2e-ns", "", "--e2e-oracle-ns", "", *none)["rows"] == [] and loaded == ran == []
    run("--e2e-ns", "", "--e2e-oracle-ns", "1", "--e2e-oracle-model", "tiny-2L", *none)
    assert loaded == ["tiny-2L"] and ran == [("tiny-2L", [1])]
    run("--e2e-ns", "1,8", "--e2e-oracle-ns", "", *none)
    assert loaded == [e2e.DRAFTER_MODEL] and ran == [(e2e.DRAFTER_MODEL, [1, 8])]
    run("--e2e-ns", "", "--e2e-oracle-ns", "")  # the sampled rows alone, at their default n
    assert loaded == [e2e.DRAFTER_MODEL] and ran == [(e2e.DRAFTER_MODEL, [1, 8])]


def test_oracle_drafts_replay_the_continuation_with_the_planted_acceptance():
    """Position j of a prompt's continuation is proposed right with probability p, planted once (the same
    at every call and from any committed length); a wrong draft is never the right token; past the
    continuation every draft is wrong."""
    from benchmarks.e2e import OracleDrafts

    prompt, cont = [5, 6, 7], [int(t) for t in np.random.default_rng(1).integers(0, 50, 4000)]
    oracle = OracleDrafts([prompt], [cont], 0.8, vocab=50, seed=0)
    drafts = oracle(0, prompt + cont[:1], len(cont) - 1)  # after the first emitted token: positions 1..
    right = np.array(drafts) == np.array(cont[1:])
    assert abs(right.mean() - 0.8) < 0.03
    assert drafts == oracle(0, prompt + cont[:1], len(cont) - 1) and oracle(0, prompt + cont[:10], 3) == drafts[9:12]
    assert [d == (c + 1) % 50 for d, c in zip(drafts, cont[1:]) if d != c] == [True] * int((~right).sum())
    assert OracleDrafts([prompt], [cont], 1.0, vocab=50, seed=0)(0, prompt + cont[:1], 5) == cont[1:6]
    never = OracleDrafts([prompt], [cont], 0.0, vocab=50, seed=0)(0, prompt + cont[:1], 100)
    assert all(d != c for d, c in zip(never, cont[1:]))
    assert oracle(0, prompt + cont, 2) == [1, 1]  # past the continuation: (0 + 1) mod V


def test_cpu_roofline_counts_routed_experts_and_the_drafter_and_measures_each_size_once(monkeypatch):
    from benchmarks import cpu_roofline

    cfg = models.config("qwen35-moe-h1024")
    st = models.settings(max_batch_size=8, max_seq_len=256, speculative=True, num_drafts=3)
    one = roofline.step_bytes(cfg, st, n=1, t=1, ctx=128, verify=False, drafter=False, weight_bytes=4)
    expert = 3 * 1024 * 96 * 4  # gate, up, down of one expert, f32
    assert one["experts_hit_per_layer"] == pytest.approx(4)  # one row: exactly its top-4 per layer
    assert one["weights_all_experts"] - one["weights_must"] == pytest.approx(16 * (32 - 4) * expert)
    with_mtp = roofline.step_bytes(cfg, st, n=1, t=1, ctx=128, verify=False, drafter=True, weight_bytes=4)
    assert with_mtp["weights_all_experts"] - with_mtp["weights_must"] == pytest.approx(17 * (32 - 4) * expert)
    assert with_mtp["kv"] == one["kv"] * 5 / 4  # the drafter's attention layer next to the trunk's four
    eight = roofline.step_bytes(cfg, st, n=8, t=1, ctx=128, verify=False, drafter=False, weight_bytes=4)
    assert eight["experts_hit_per_layer"] == pytest.approx(32 * (1 - (1 - 4 / 32) ** 8))  # uniform routing
    measured: list[int] = []
    monkeypatch.setattr(cpu_roofline, "read_bandwidth", lambda nbytes: measured.append(nbytes) or 1e10)
    bw = cpu_roofline.Bandwidths(past_cache=5e9)
    a = cpu_roofline.step_roofline(bw, cfg, st, n=1, t=1, ctx=128, verify=False, drafter=False, weight_bytes=4)
    cpu_roofline.step_roofline(bw, cfg, st, n=1, t=1, ctx=256, verify=False, drafter=False, weight_bytes=4)
    cpu_roofline.step_roofline(bw, cfg, st, n=8, t=1, ctx=128, verify=False, drafter=False, weight_bytes=4)
    assert measured == [int(one["weights_must"]), int(eight["weights_must"])]  # one read per weights size
    assert a["floor_s"] == pytest.approx(one["total_must"] / 1e10)
    assert a["floor_past_cache_s"] == pytest.approx(one["total_must"] / 5e9)
