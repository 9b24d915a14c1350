"""The engine's one program list: what it lists for given settings, that `Engine.warm_up` compiles
every program a run then calls (no step compiles: `ProgramCache.compilations` unchanged), that a
warmed program is disclosed only once it runs, and the persistent compilation cache's switch."""

import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest
from conftest import settings

from metrale_jax import runtime_env
from metrale_jax.engine.capacity import pool_counts
from metrale_jax.engine.engine import Engine, make_ops
from metrale_jax.engine.program_list import batch_widths, generation_programs, prefill_buckets, serve_programs
from metrale_jax.engine.sharding import abstract_pool
from metrale_jax.engine.speculative import DraftSchedule, greedy_generate, speculative_generate
from metrale_jax.memory.activations import step_programs

PROMPTS = [[70 + i for i in range(20)], [90, 91, 92]]


def test_prefill_buckets_and_widths(tiny):
    cfg, _ = tiny
    counts = pool_counts(settings(max_batch_size=5, max_seq_len=100), cfg)
    assert counts.prefill_chunk == 100
    assert prefill_buckets(counts) == (16, 32, 64, 100)
    assert prefill_buckets(counts, [3, 20, 250]) == (16, 32, 64, 100)  # 250 = 100 + 100 + 50
    assert prefill_buckets(counts, [3]) == (16,)
    assert batch_widths(counts) == (1, 2, 4, 8)
    assert counts.draft_table_width == 100 // 16 + 2


def test_the_list_holds_every_program_kind_once_per_shape(tiny):
    cfg, params = tiny
    s = settings(max_batch_size=3, max_seq_len=64, speculative=True, num_drafts=2, enable_prefix_caching=True)
    counts = pool_counts(s, cfg)
    pool = abstract_pool(cfg, counts, s, dtype=jnp.float32, mesh=None)
    programs = serve_programs(cfg, counts, s, make_ops("xla"), pool, params)
    names = [p.name for p in programs]
    per_width = ["decode", "verify", "gdn_fold", "commit_conv", "restore_ckpt", "propose", "propose", "stash_rows"]
    per_width += ["speculative"] * 3
    assert names == ["prefill"] * 3 + per_width * 3 + ["restore_snapshot", "take_snapshot", "read_state", "write_state"]
    keys = [(p.transition, p.static, p.width) for p in programs]
    assert len(set(keys)) == len(keys)
    planned = step_programs(cfg, counts, s, params, pool, programs[0].static.ops)
    assert [(p.name, p.width) for p in planned] == [
        ("prefill", 64),
        ("decode", 4),
        ("verify", 4),
        ("propose", 4),
        ("speculative", 4),
    ]
    assert planned[3].static.num_drafts == planned[4].static.num_drafts == 2


@pytest.fixture(scope="module")
def plain(tiny):
    cfg, params = tiny
    return Engine(cfg, params, settings(max_batch_size=2, max_seq_len=32))


def test_after_warm_up_no_step_compiles(plain):
    assert plain.warm_up() > 0
    warmed = plain.programs.compilations
    assert warmed == 2 + 2 + 2  # prefill 16 and 32, decode at widths 1 and 2, swap out and in
    assert plain.disclosure()["programs"] == []  # compiled ahead of time, not run yet
    greedy_generate(plain, PROMPTS, 6)
    greedy_generate(plain, PROMPTS[1:], 6)
    seq = plain.alloc_sequence()
    plain.prefill(seq, PROMPTS[0])
    record = plain.save_sequence_state(seq)
    plain.free_sequence(seq)
    seq = plain.alloc_sequence()
    plain.restore_sequence_state(seq, record)
    plain.free_sequence(seq)
    assert plain.programs.compilations == warmed
    # the forward's programs, in the order they first ran (buckets 32 and 16, widths 2 and 1)
    assert [p["name"] for p in plain.disclosure()["programs"]] == ["prefill_chunk"] * 2 + ["step_rows"] * 2
    assert plain.warm_up() >= 0 and plain.programs.compilations == warmed  # nothing left to compile


@pytest.fixture(scope="module")
def spec(tiny):
    cfg, params = tiny
    return Engine(cfg, params, settings(max_batch_size=1, max_seq_len=48, speculative=True, num_drafts=2))


@pytest.mark.parametrize("path", ["fused", "composed"])
def test_a_generation_runs_only_the_programs_it_warmed(spec, path):
    spec.warm_up(None, generation_programs(spec.counts, [len(PROMPTS[0])], path))
    warmed = spec.programs.compilations
    speculative_generate(spec, PROMPTS[:1], 12, DraftSchedule(2), fused=path == "fused")
    assert spec.programs.compilations == warmed


def test_compilation_cache_dir_switch(monkeypatch, tmp_path):
    monkeypatch.setenv(runtime_env.COMPILATION_CACHE_ENV, "Off")
    assert runtime_env.compilation_cache_dir() is None
    monkeypatch.setenv(runtime_env.COMPILATION_CACHE_ENV, str(tmp_path))
    assert runtime_env.compilation_cache_dir() == tmp_path
    monkeypatch.delenv(runtime_env.COMPILATION_CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert runtime_env.compilation_cache_dir() == tmp_path / "metrale-jax" / "jax"


def test_generate_fills_the_persistent_cache_it_is_given(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env[runtime_env.COMPILATION_CACHE_ENV] = str(tmp_path / "jax")
    cli = Path(sys.executable).parent / "metrale-jax"
    args = [str(cli), "generate", "--checkpoint", "tiny", "--prompt", "hi", "--max-new-tokens", "2"]
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "; 0 compiled after the warm-up" in r.stdout
    assert len(list((tmp_path / "jax").iterdir())) >= 2  # the prefill and the decode
