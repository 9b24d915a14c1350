"""`metrale-jax memory` activations: XLA's memory analysis of the engine's step programs.

The planner's figure must equal what the programs the Engine really compiles report; probes of
the inverse queries compile once per distinct shape set (interpolating in the KV block counts,
checked against a compiled program); the analyses are cached on disk; `--no-activations` skips
them. Compilation dominates: every test shares one cache directory (module scope), and the
workload `ISL 1 + OSL 511` makes every probe of the tiny-mtp serve the headline's own shapes.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

from metrale_jax.engine.capacity import bucket_width, pool_counts
from metrale_jax.engine.engine import Engine
from metrale_jax.engine.settings import resolve_settings
from metrale_jax.memory.activations import CACHE_ENV, ActivationModel, source_files
from metrale_jax.memory.devices import find_device
from metrale_jax.memory.plan import Planner, Workload
from metrale_jax.memory.source import resolve_model
from metrale_jax.model.layer_groups import layer_groups, layer_period, truncate_groups
from metrale_jax.presets import PRESETS, resolve_checkpoint
from metrale_jax_cli.memory_cmd import memory, plan
from metrale_jax_cli.recipes import REPO_RECIPES_DIR

#: ISL + OSL = the tiny-mtp recipe's max_model_len (512): the planner's KV pools are then the
#: Engine's own (it sizes them for max_seq_len), and the max-ISL search has one point.
ARGS = [
    "--checkpoint",
    "tiny",
    "--device",
    "H200",
    "--isl",
    "1",
    "--osl",
    "511",
    "--concurrency",
    "12",
    "--recipe",
    "metrale-jax/tiny-mtp",
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("activations")
    old = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(path)
    yield path
    if old is None:
        del os.environ[CACHE_ENV]
    else:
        os.environ[CACHE_ENV] = old


@pytest.fixture(scope="module")
def report(cache):
    return plan("tiny", "H200", 1, 511, 12, "metrale-jax/tiny-mtp", None, None, REPO_RECIPES_DIR, ())


def _engine_programs(settings):
    """Run a full-width prefill, decode, fused speculative step, verify and propose on a real
    Engine; return its compiled programs by planner name."""
    cfg, params = resolve_checkpoint("tiny")
    eng = Engine(cfg, params, settings)
    n = eng.counts.real_slots
    assert bucket_width(n) == n == 12
    seqs = [eng.alloc_sequence() for _ in range(n)]
    rng = np.random.default_rng(0)
    for s in seqs:
        eng.prefill(s, rng.integers(0, cfg.vocab_size, eng.counts.prefill_chunk).tolist())
    eng.decode_batch(seqs, [1] * n)
    eng.speculative_step(seqs, [1] * n, [1] * n, settings.num_drafts)
    eng.verify_batched(seqs, [2] * n, [1] * n)
    eng.propose_batched(seqs, [3] * n, settings.num_drafts)
    out = {}
    for key, prog in eng.programs._programs.items():
        name, static = key[0], key[1]
        label = {"prefill_chunk": "prefill", "propose": "propose", "speculative_step": "speculative"}.get(name)
        if name == "step_rows":
            label = "verify" if static.verify else "decode"
        out[label] = prog
    return out


def test_activation_figure_equals_the_engines_compiled_programs(report):
    """Planned == compiled: each program's scratch and fresh outputs are exactly what
    `memory_analysis()` says of the program the Engine compiled at the same settings."""
    ev = report.evaluation
    act = ev.activations
    assert act.backend == jax.default_backend() and act.forward == "xla"
    assert [p.name for p in act.programs] == ["prefill", "decode", "verify", "propose", "speculative"]
    assert all(p.how == "compiled" for p in act.programs)
    assert report.activation_run["compiled"] == 5  # every probe shares the headline's shapes
    assert report.activation_run["compile_wall_seconds"] > 0  # the user's wait is reported, not only the sum
    engine = _engine_programs(ev.settings)
    for p in act.programs:
        ma = engine[p.name].memory_analysis()
        assert (p.temp, p.outputs) == (ma.temp_size_in_bytes, ma.output_size_in_bytes - ma.alias_size_in_bytes), p.name
    assert act.bytes == max(p.temp + p.outputs for p in act.programs) > 0
    assert ev.device_total == ev.weight_bytes + ev.pool_bytes + act.bytes + ev.runtime


def test_second_run_is_served_from_the_disk_cache(report, cache):
    r = CliRunner().invoke(memory, [*ARGS, "--json"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    a = d["activations"]
    assert a["run"] == {
        "compiled": 0,
        "compile_seconds": 0.0,
        "compile_wall_seconds": 0.0,
        "cache_hits": 5,
        "cache_dir": str(cache),
    }
    assert [p["source"] for p in a["programs"]] == ["cache"] * 5
    assert [p["temp_bytes"] for p in a["programs"]] == [p.temp for p in report.evaluation.activations.programs]
    t = d["totals"]
    assert t["activations"] == a["bytes"] == max(p["bytes"] for p in a["programs"])
    assert t["device_total"] == (t["weights"] + sum(t["pools"].values()) + t["activations"] + t["runtime_reserve"])
    assert a["backend"] == jax.default_backend()
    text = CliRunner().invoke(memory, ARGS).stdout
    assert f"backend {jax.default_backend()}" in text
    assert f"Compiled nothing: 5 program(s) from the cache ({cache})." in text


def test_probes_compile_once_per_shape_set_and_interpolate_within_10_percent(report, cache):
    """The max-ISL search moves only the KV block counts: two extra shape sets (each count moved
    alone to the far end of the serve's range) are compiled, not one per probe, and an
    interpolated probe is within 10% of the program compiled at its own shapes. The headline
    figure is never interpolated: it is the compiled program's own analysis."""
    ev = report.evaluation
    cfg = PRESETS["tiny"][0]
    model = ActivationModel(cfg, jnp.float32, programs=("prefill",))
    planner = Planner(cfg, ev.settings, find_device("L4"), jnp.float32, (), activations=model)
    planner.evaluate(Workload(12, 1, 511))  # the anchor: from the cache
    assert (model.compiled, model.cache_hits) == (0, 1)
    assert planner.max_isl(12, 50) == 462
    assert model.compiled == 2  # kv blocks moved, drafter blocks moved
    probe = planner.probe(Workload(12, 100, 50))
    assert model.compiled == 2
    (p,) = probe.activations.programs
    assert p.how == "interpolated" and "affine in KV blocks" in probe.activations.note
    exact = model.exact(probe.settings, probe.counts)["prefill"]
    assert exact.how == "compiled" and p.outputs == exact.outputs
    assert abs(p.temp - exact.temp) <= 0.10 * exact.temp
    # attention gathers from the stacked cache (no per-layer KV copy), so the prefill scratch is
    # the same at the probe's block count as at the anchor's
    assert exact.temp == next(q.temp for q in ev.activations.programs if q.name == "prefill")


def test_a_deep_model_is_planned_from_two_depths_byte_for_byte(report, tmp_path):
    """A model of 3 layer groups is compiled at 1 and 2 groups and extended affinely: every program's
    scratch and fresh outputs equal the programs compiled at the full depth, byte for byte, and no
    full-depth program is compiled; the propose, which runs no trunk layer, is compiled at one depth."""
    ev = report.evaluation
    tiny = PRESETS["tiny"][0]
    p, n = tiny.num_hidden_layers, 3 * tiny.num_hidden_layers
    cfg = dataclasses.replace(
        tiny,
        num_hidden_layers=n,
        layer_types=tiny.layer_types * 3,
        mlp_only_layers=tuple(i + g * p for g in range(3) for i in tiny.mlp_only_layers),
    )
    assert layer_period(cfg) == p and layer_groups(cfg) == 3
    probed = ActivationModel(cfg, jnp.float32, cache_dir=tmp_path / "probed")
    assert [c.num_hidden_layers for c in probed.depths()] == [n // 3, 2 * n // 3]
    full = ActivationModel(cfg, jnp.float32, cache_dir=tmp_path / "full", full_depth=True)
    got, want = probed.exact(ev.settings, ev.counts), full.exact(ev.settings, ev.counts)
    assert (probed.compiled, full.compiled) == (9, 5)
    assert list(got) == list(want) == ["prefill", "decode", "verify", "propose", "speculative"]
    for name, p in got.items():
        assert (p.temp, p.outputs) == (want[name].temp, want[name].outputs), name
        depth = "1 group (runs no trunk layer)" if name == "propose" else "1+2 groups"
        assert p.how == f"compiled, depth {depth}" and want[name].how == "compiled"


_80B = resolve_model("Qwen/Qwen3-Next-80B-A3B-Instruct", REPO_RECIPES_DIR).config


def _80b_prefill_scratch(cache_dir, groups: int, tokens: int) -> int:
    """Scratch bytes of the bf16 80B's prefill program, cut to `groups` layer groups, for a chunk of
    `tokens` (one slot, compiled into `cache_dir`)."""
    cfg = truncate_groups(_80B, groups)
    flags = {"max_batch_size": "1", "max_seq_len": 2 * tokens, "max_prefill_tokens": tokens, "kv_cache_dtype": "bf16"}
    settings = resolve_settings(flags, None, auto_slots=1)
    model = ActivationModel(cfg, jnp.bfloat16, cache_dir=cache_dir, programs=("prefill",))
    return model.exact(settings, pool_counts(settings, cfg))["prefill"].temp


def test_the_80b_prefill_holds_no_router_index_buffer_per_layer(tmp_path):
    """At the 80B's widths (512 experts, bf16), a 2048-token prefill chunk compiled at 1 and at 2 layer
    groups differs by under one [tokens, experts] int32 buffer, where a group has 4 MoE layers: no
    router's top-k indices are held from the program's start (`mlp.top_k`; with `lax.top_k` XLA CPU
    held each layer's, 4.09 such buffers more at 2 groups)."""
    tokens = 2048
    temp = [_80b_prefill_scratch(tmp_path, groups, tokens) for groups in (1, 2)]
    assert 0 <= temp[1] - temp[0] < tokens * _80B.num_experts * 4, temp


def test_the_80b_prefill_does_not_hold_the_lm_heads_f32_copy_through_its_layers(tmp_path):
    """XLA CPU converts the bf16 lm_head [V, Hd] to f32 for its product; ordered after the rows
    (`trunk.lm_head`) the copy is not live while the layers run: one layer group's 8192-token prefill
    compiles to less than two such copies (measured 1,416 MB against a 1,245 MB copy; 2,661 MB when
    XLA scheduled the copy at the program's start)."""
    temp = _80b_prefill_scratch(tmp_path, 1, 8192)
    copy = _80B.vocab_size * _80B.hidden_size * 4
    assert temp < 2 * copy, (temp, copy)


def test_a_probe_that_cannot_fit_compiles_nothing(report, tmp_path):
    """Activations are never negative: on a device that the pools alone overflow, the inverse
    queries find nothing fits without compiling a step program."""
    ev = report.evaluation
    cfg = PRESETS["tiny"][0]
    small = dataclasses.replace(find_device("L4"), memory_bytes=1 << 20)
    model = ActivationModel(cfg, jnp.float32, cache_dir=tmp_path)
    planner = Planner(cfg, ev.settings, small, jnp.float32, (), activations=model)
    assert planner.max_isl(12, 50) is None and planner.max_concurrency(1, 50, 12) is None
    assert model.compiled == 0 and model.cache_hits == 0
    assert not planner.evaluate(Workload(12, 1, 511), activations=False).fits


def test_no_activations_skips_them():
    r = CliRunner().invoke(memory, [*ARGS, "--no-activations", "--json"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["activations"] is None and d["totals"]["activations"] == 0
    t = d["totals"]
    assert t["device_total"] == t["weights"] + sum(t["pools"].values()) + t["runtime_reserve"]
    out = CliRunner().invoke(memory, [*ARGS, "--no-activations"]).stdout
    assert "## Activations: not computed (--no-activations); not charged" in out
    assert "activations (not computed: --no-activations)" in out


def test_cache_key_covers_the_reference_kernels():
    """The `xla` forward runs the jnp twins in kernels_pallas, and `linear` the CPU rows kernel: an
    edit there must change the activation cache key, or a warm cache would serve stale entries."""
    names = {f.as_posix().split("/kernels_pallas/")[-1] for f in source_files() if "kernels_pallas" in f.parts}
    assert {"gdn/reference.py", "paged_attention/reference.py", "ops.py"} <= names
    assert any(f.name == "transitions.py" for f in source_files())
    cpu = {f.as_posix().split("/kernels_cpu/")[-1] for f in source_files() if "kernels_cpu" in f.parts}
    assert {"rows_matmul/api.py", "rows_matmul/rows_matmul.cc"} <= cpu
