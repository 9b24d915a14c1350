"""Serve settings: the flag table as Click options, MODEL.toml `[behavior]`, K-ladder text, resolution and
validation."""

from __future__ import annotations

import math

import click
import jax
import jax.numpy as jnp
import pytest
from click.testing import CliRunner

from metrale_jax.engine.capacity import DEFAULT_K_LADDER
from metrale_jax.engine.settings import (
    RULE_DEFAULT,
    RULE_FLAG,
    SERVE_DEFAULTS,
    Behavior,
    EngineSettings,
    SettingsError,
    format_k_ladder,
    parse_k_ladder,
    resolve_settings,
)
from metrale_jax_cli.model_toml import BehaviorError, load_behavior, parse_behavior
from metrale_jax_cli.serve_flags import SERVE_FLAGS, pop_serve_raw, serve_options

TOML = Behavior(default_num_drafts=2, mtp_max_seqs=64, default_kv_dtype="bf16", source="M.toml")


def resolve(raw=None, behavior=None, auto_slots=8) -> EngineSettings:
    return resolve_settings(raw or {}, behavior, auto_slots=auto_slots)


def rules(s: EngineSettings) -> dict[str, str]:
    return {p.setting: p.rule for p in s.provenance}


def violations(raw, behavior=None) -> tuple[str, ...]:
    with pytest.raises(SettingsError) as e:
        resolve(raw, behavior)
    return e.value.messages


# ---- resolution ----


def test_engine_defaults_and_their_provenance():
    s = resolve()
    assert (s.max_batch_size, s.max_seq_len, s.block_size, s.speculative) == (8, 32768, 16, False)
    assert (s.num_drafts, s.mtp_max_seqs, s.k_ladder) == (1, 32, DEFAULT_K_LADDER)
    assert (s.kv_cache_dtype, s.ssm_h_dtype, s.ssm_rollback_mode) == ("fp8", "f32", "snapshot")
    assert (s.max_prefill_tokens, s.enable_prefix_caching, s.ssm_cache_slots) == (8192, False, 16)
    assert (s.ssm_decode_ring_slots, s.gpu_memory_utilization) == (0, 0.90)
    assert all(p.requested == "" for p in s.provenance)
    assert set(rules(s).values()) <= {RULE_DEFAULT, "auto (off: no decode watchdog to roll back for)"}
    assert [p.setting for p in s.provenance][:3] == ["--max-batch-size", "--max-seq-len", "--block-size"]


@pytest.mark.parametrize(
    "raw, behavior, want, rule",
    [
        ({"num_drafts": 1, "speculative": True}, TOML, 1, RULE_FLAG),  # an explicit 1 still wins
        ({"speculative": True}, TOML, 2, "MODEL.toml [behavior] default_num_drafts"),
        ({"speculative": True}, Behavior(), 1, RULE_DEFAULT),  # 0 in MODEL.toml = absent
        ({"speculative": True}, None, 1, RULE_DEFAULT),
    ],
)
def test_num_drafts_flag_then_model_toml_then_default(raw, behavior, want, rule):
    s = resolve(raw, behavior)
    assert s.num_drafts == want and rules(s)["--num-drafts"] == rule


@pytest.mark.parametrize(
    "raw, behavior, want, rule",
    [
        ({"mtp_max_seqs": 8}, TOML, 8, RULE_FLAG),
        ({}, TOML, 64, "MODEL.toml [behavior] mtp_max_seqs"),
        ({}, None, 32, RULE_DEFAULT),
    ],
)
def test_mtp_max_seqs_flag_then_model_toml_then_32(raw, behavior, want, rule):
    s = resolve(raw, behavior)
    assert s.mtp_max_seqs == want and rules(s)["--mtp-max-seqs"] == rule


@pytest.mark.parametrize(
    "raw, behavior, want, rule",
    [
        ({"kv_cache_dtype": "bf16"}, TOML, "bf16", RULE_FLAG),
        ({"kv_cache_dtype": "f32"}, TOML, "f32", "flag (MODEL.toml says bf16)"),
        ({}, TOML, "bf16", "MODEL.toml [behavior] default_kv_dtype"),
        ({}, None, "fp8", RULE_DEFAULT),
    ],
)
def test_kv_dtype_flag_then_model_toml_then_fp8(raw, behavior, want, rule):
    s = resolve(raw, behavior)
    assert s.kv_cache_dtype == want and rules(s)["--kv-cache-dtype"] == rule


def test_max_batch_size_number_or_auto():
    assert resolve({"max_batch_size": "12"}).max_batch_size == 12
    s = resolve({"max_batch_size": "auto"}, auto_slots=37)
    assert s.max_batch_size == 37 and rules(s)["--max-batch-size"] == "auto (37 slots)"
    with pytest.raises(ValueError):
        resolve({}, auto_slots=0)


def test_ring_auto_is_off_and_explicit_depths_are_kept():
    assert resolve({}).ssm_decode_ring_slots == 0
    assert resolve({"speculative": True}).ssm_decode_ring_slots == 0
    assert resolve({"ssm_decode_ring_slots": "3"}).ssm_decode_ring_slots == 3
    assert resolve({"speculative": True, "ssm_decode_ring_slots": "2"}).ssm_decode_ring_slots == 2


def test_k_ladder_flag():
    s = resolve({"mtp_k_ladder": "2:2,32:1"})
    assert s.k_ladder == ((2, 2), (32, 1)) and rules(s)["--mtp-k-ladder"] == RULE_FLAG


def test_requested_and_effective_columns():
    s = resolve({"speculative": True, "max_batch_size": "auto"}, TOML, auto_slots=5)
    table = {p.setting: (p.requested, p.effective) for p in s.provenance}
    assert table["--speculative"] == ("on", "on")
    assert table["--max-batch-size"] == ("auto", "5")
    assert table["--num-drafts"] == ("", "2")
    assert table["--mtp-k-ladder"] == ("", "4:3,8:3,16:1,32:1")


# ---- validation: every violation, one message each ----


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"max_batch_size": "0"}, "--max-batch-size"),
        ({"max_batch_size": "129"}, "--max-batch-size"),
        ({"max_batch_size": "many"}, "--max-batch-size"),
        ({"max_seq_len": 0}, "--max-seq-len"),
        ({"block_size": 0}, "--block-size"),
        ({"max_prefill_tokens": 0}, "--max-prefill-tokens"),
        ({"ssm_cache_slots": -1}, "--ssm-cache-slots"),
        ({"num_drafts": 0, "speculative": True}, "--num-drafts must be >= 1"),
        ({"num_drafts": 2}, "--num-drafts 2 needs --speculative"),
        ({"mtp_max_seqs": 0}, "--mtp-max-seqs 0 (flag)"),
        ({"mtp_max_seqs": 129}, "--mtp-max-seqs 129 (flag)"),
        ({"mtp_k_ladder": "4:3,2:1"}, "--mtp-k-ladder: K ladder step '2:1'"),
        ({"kv_cache_dtype": "nvfp4"}, "--kv-cache-dtype 'nvfp4' (flag)"),
        ({"ssm_h_dtype": "f16"}, "--ssm-h-dtype"),
        ({"ssm_rollback_mode": "rewind"}, "--ssm-rollback-mode"),
        ({"ssm_decode_ring_slots": "9"}, "--ssm-decode-ring-slots"),
        ({"ssm_decode_ring_slots": "deep"}, "--ssm-decode-ring-slots"),
        ({"gpu_memory_utilization": 0.0}, "(0, 1]"),
        ({"gpu_memory_utilization": -0.5}, "(0, 1]"),
        ({"gpu_memory_utilization": 1.01}, "(0, 1]"),
        ({"gpu_memory_utilization": math.nan}, "(0, 1]"),
    ],
)
def test_each_violation(raw, needle):
    messages = violations(raw)
    assert len(messages) == 1 and needle in messages[0]


def test_edges_that_are_allowed():
    s = resolve(
        {
            "mtp_max_seqs": 128,
            "gpu_memory_utilization": 1.0,
            "num_drafts": 1,
            "max_batch_size": "128",
            "ssm_cache_slots": 0,
            "ssm_decode_ring_slots": "0",
        }
    )
    assert (s.mtp_max_seqs, s.gpu_memory_utilization, s.max_batch_size) == (128, 1.0, 128)


def test_every_violation_is_collected_into_one_error():
    messages = violations(
        {
            "max_batch_size": "x",
            "num_drafts": 3,
            "mtp_max_seqs": 0,
            "kv_cache_dtype": "int4",
            "gpu_memory_utilization": 2.0,
            "mtp_k_ladder": "bad",
            "ssm_decode_ring_slots": "99",
        }
    )
    assert len(messages) == 7
    assert str(SettingsError(messages)).count("\n") == 6


def test_model_toml_values_are_validated_too_and_named():
    messages = violations({}, Behavior(mtp_max_seqs=500, default_kv_dtype="int8", source="M"))
    assert messages == (
        "--mtp-max-seqs 500 (MODEL.toml [behavior] mtp_max_seqs) must be in 1..=128",
        "--kv-cache-dtype 'int8' (MODEL.toml [behavior] default_kv_dtype) must be one of bf16, fp8, f32",
    )


def test_unknown_raw_keys_are_refused():
    assert violations({"tensor_parallel": 2}) == ("unknown serve setting 'tensor_parallel'",)


# ---- EngineSettings ----


def test_settings_are_hashable_and_static_under_jit():
    a = resolve({"speculative": True}, TOML)
    b = resolve({"speculative": True, "num_drafts": 2, "mtp_max_seqs": 64, "kv_cache_dtype": "bf16"})
    assert a == b and hash(a) == hash(b)  # provenance differs but takes no part
    calls = []

    def f(x, settings):
        calls.append(settings)
        return x * settings.num_drafts

    g = jax.jit(f, static_argnames="settings")
    assert float(g(jnp.float32(2), settings=a)) == 4.0
    g(jnp.float32(3), settings=b)
    assert len(calls) == 1  # equal settings: one trace


# ---- K ladder text ----


def test_parse_default_ladder_text_and_round_trip():
    assert parse_k_ladder("4:3,8:3,16:1,32:1") == DEFAULT_K_LADDER
    assert parse_k_ladder(" 2:2 , 32 : 1 ") == ((2, 2), (32, 1))
    assert parse_k_ladder(format_k_ladder(DEFAULT_K_LADDER)) == DEFAULT_K_LADDER


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("", "empty"),
        ("4", "not n_max:drafts"),
        ("4:3,", "not n_max:drafts"),
        ("a:b", "not n_max:drafts"),
        ("4:3;8:1", "not n_max:drafts"),
        ("-1:2", "not n_max:drafts"),
        ("4:3:1", "not n_max:drafts"),
        ("0:1", ">= 1"),
        ("4:0", ">= 1"),
        ("8:3,4:1", "must increase"),
        ("4:3,4:1", "must increase"),
    ],
)
def test_malformed_ladder_is_refused_whole(spec, needle):
    with pytest.raises(ValueError, match=needle):
        parse_k_ladder(spec)


# ---- MODEL.toml ----


def test_behavior_parse_reads_three_keys_and_ignores_the_rest():
    b = parse_behavior(
        "[behavior]\ndefault_num_drafts = 3\nmtp_max_seqs = 128\n"
        'default_kv_dtype = "bf16"\nthinking_default = true\n[dflash]\ngamma = 16\n',
        "x/MODEL.toml",
    )
    assert (b.default_num_drafts, b.mtp_max_seqs, b.default_kv_dtype, b.source) == (3, 128, "bf16", "x/MODEL.toml")
    assert parse_behavior("# nothing\n", "s") == Behavior(source="s")


@pytest.mark.parametrize(
    "text, needle",
    [
        ('[behavior]\ndefault_num_drafts = "3"\n', "default_num_drafts must be a non-negative integer"),
        ("[behavior]\nmtp_max_seqs = true\n", "mtp_max_seqs must be a non-negative integer"),
        ("[behavior]\nmtp_max_seqs = 2.5\n", "mtp_max_seqs must be a non-negative integer"),
        ("[behavior]\ndefault_num_drafts = -1\n", "default_num_drafts must be a non-negative integer"),
        ("[behavior]\ndefault_kv_dtype = 8\n", "default_kv_dtype must be a string"),
        ('behavior = "fast"\n', "[behavior] must be a table"),
        ("[behavior\n", "not valid TOML"),
    ],
)
def test_behavior_wrong_types_are_clear_errors(text, needle):
    with pytest.raises(BehaviorError) as e:
        parse_behavior(text, "m/MODEL.toml")
    assert str(e.value).startswith("m/MODEL.toml: ") and needle in str(e.value)
    assert "\n" not in str(e.value)


def test_absent_model_toml_means_engine_defaults(tmp_path):
    b = load_behavior(tmp_path / "MODEL.toml")
    assert (b.default_num_drafts, b.mtp_max_seqs, b.default_kv_dtype) == (0, 0, "")
    assert "absent: engine defaults" in b.source


# ---- the Click option set ----


@click.command()
@serve_options
@click.pass_context
def _probe(ctx, **kwargs):
    raw = pop_serve_raw(ctx, kwargs)
    s = resolve_settings(raw, None, auto_slots=4)
    click.echo(f"{sorted(raw)} {s.max_batch_size} {s.speculative} {s.num_drafts} {s.gpu_memory_utilization} {kwargs}")


def test_serve_options_parse_and_pop_only_the_given_flags():
    r = CliRunner().invoke(
        _probe, ["--speculative", "--num-drafts", "3", "--max-batch-size", "auto", "--gpu-memory-utilization", "0.5"]
    )
    assert r.exit_code == 0, r.output
    assert r.output.strip() == (
        "['gpu_memory_utilization', 'max_batch_size', 'num_drafts', 'speculative'] 4 True 3 0.5 {}"
    )


def test_presence_only_booleans_have_a_negative_spelling():
    r = CliRunner().invoke(_probe, ["--no-speculative"])
    assert r.exit_code == 0 and "['speculative'] 8 False" in r.output
    r = CliRunner().invoke(_probe, ["--disable-prefix-caching"])
    assert r.exit_code == 0
    # Both spellings at once are a flag given twice: refused (tests/test_hostile_runs.py).
    r = CliRunner().invoke(_probe, ["--speculative", "--no-speculative"])
    assert "--speculative given 2 times" in str(r.exception)


def test_serve_options_help_lists_every_flag():
    r = CliRunner().invoke(_probe, ["--help"])
    for flag in (
        "--max-batch-size",
        "--mtp-k-ladder",
        "--kv-cache-dtype",
        "--ssm-h-dtype",
        "--ssm-decode-ring-slots",
        "--gpu-memory-utilization",
        "--enable-prefix-caching",
    ):
        assert flag in r.output


def test_the_flag_table_names_every_engine_setting_once_in_its_order():
    """The CLI's table (spellings, types, help) and the engine's settings (names, defaults) are one list."""
    assert [flag.name for flag in SERVE_FLAGS] == list(SERVE_DEFAULTS)
    assert all(flag.help and flag.opt.startswith("--") for flag in SERVE_FLAGS)
