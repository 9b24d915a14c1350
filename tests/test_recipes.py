"""Serve recipes: schema, rendering, run-time overrides, and parsing with the serve option set."""

from __future__ import annotations

import textwrap

import pytest

from metrale_jax.engine.settings import SettingsError, resolve_settings
from metrale_jax.memory.source import resolve_model
from metrale_jax_cli.model_toml import load_behavior
from metrale_jax_cli.recipes import (
    REPO_RECIPES_DIR,
    RecipeError,
    flag_for_key,
    load_recipe,
    override_flags,
    parse_recipe,
    recipe_ids,
    render_argv,
    serve_argv,
)
from metrale_jax_cli.serve_flags import parse_serve_argv

GOOD = """\
recipe_version: "2"
model: org/model
runtime: metrale-jax
container: metrale-jax/x:latest
metadata:
  description: a recipe
  updated: 2026-10-02
defaults:
  max_model_len: 8192
  max_batch_size: 2
  gpu_memory_utilization: 0.85
  speculative: true
  enable_prefix_caching: false
  mtp_k_ladder: "2:2,32:1"
env:
  METRALE_EXAMPLE: 1
"""


def v(text: str) -> list[str]:
    return text.split()


def with_defaults(body: str) -> str:
    head = GOOD[: GOOD.index("defaults:")]
    return head + "defaults:\n" + textwrap.indent(textwrap.dedent(body), "  ")


# ---- overrides ----


def test_a_later_flag_replaces_the_recipes_value():
    argv = v("m --gpu-memory-utilization 0.90 --speculative --max-seq-len 8192")
    assert override_flags(argv, v("--gpu-memory-utilization 0.85")) == v(
        "m --speculative --max-seq-len 8192 --gpu-memory-utilization 0.85"
    )
    assert override_flags(argv, v("--speculative --max-seq-len=4096")) == v(
        "m --gpu-memory-utilization 0.90 --speculative --max-seq-len=4096"
    )


def test_override_edge_cases():
    argv = v("m --max-seq-len=8192 --block-size 32 --speculative --num-drafts 3")
    # a `--flag=v` occurrence is dropped alone; the next token is not taken as its value
    assert override_flags(argv, v("--max-seq-len 100")) == v(
        "m --block-size 32 --speculative --num-drafts 3 --max-seq-len 100"
    )
    # a boolean flag followed by another flag drops nothing else
    assert override_flags(v("m --speculative --block-size 32"), v("--speculative")) == v(
        "m --block-size 32 --speculative"
    )
    assert override_flags(argv, []) == argv
    assert override_flags(argv, v("--num-drafts 1")) == v(
        "m --max-seq-len=8192 --block-size 32 --speculative --num-drafts 1"
    )


def test_a_negative_boolean_after_the_recipes_turns_it_off():
    argv = override_flags(v("m --speculative --block-size 32"), v("--no-speculative"))
    _, raw = parse_serve_argv(argv)
    assert raw == {"speculative": False, "block_size": 32}


# ---- schema ----


def test_parse_and_render_a_good_recipe():
    r = parse_recipe("fam/stem", GOOD)
    assert (r.id, r.model, r.runtime, r.min_nodes, r.max_nodes) == ("fam/stem", "org/model", "metrale-jax", 1, None)
    assert dict(r.metadata) == {"description": "a recipe", "updated": "2026-10-02"}
    assert dict(r.env) == {"METRALE_EXAMPLE": "1"}
    assert render_argv(r) == v(
        "org/model --max-seq-len 8192 --max-batch-size 2 "
        "--gpu-memory-utilization 0.85 --speculative --mtp-k-ladder "
        "2:2,32:1"
    )


def test_key_to_flag_rules():
    assert flag_for_key("max_model_len") == "--max-seq-len"
    assert flag_for_key("tensor_parallel") == "--tp-size"
    assert flag_for_key("host") == "--bind"
    assert flag_for_key("ssm_cache_slots") == "--ssm-cache-slots"


@pytest.mark.parametrize(
    "text, needle",
    [
        ("- a\n- b\n", "top level must be a mapping"),
        (GOOD + "max_num_seqs: 2\n", "unknown top-level key(s) max_num_seqs"),
        (GOOD.replace("container: metrale-jax/x:latest\n", ""), "missing required key(s) container"),
        (GOOD.replace('recipe_version: "2"', 'recipe_version: "1"'), "recipe_version must be"),
        (GOOD.replace("model: org/model", "model: 7"), "model must be a non-empty string"),
        (GOOD + "min_nodes: 0\n", "min_nodes must be a positive integer"),
        (GOOD + "min_nodes: 2\nmax_nodes: 1\n", "max_nodes 1 is below min_nodes 2"),
        (GOOD.replace("  updated:", "  colour: red\n  updated:"), "unknown metadata key(s) colour"),
        (GOOD + "env: [a]\n", "env must be a mapping"),
        (GOOD.replace("defaults:\n", "defaults: 3\nx:\n"), "unknown top-level key"),
        (with_defaults("speculative: yes please\n"), "presence-only flag; write true or false"),
        (with_defaults("speculative: 1\n"), "presence-only flag; write true or false"),
        (with_defaults("max_batch_size: true\n"), "takes a scalar value"),
        (with_defaults("max_batch_size: [1, 2]\n"), "takes a scalar value"),
        (with_defaults("max_batch_size: {a: 1}\n"), "takes a scalar value"),
        (with_defaults("max_batch_size:\n"), "takes a scalar value"),
        (with_defaults("tensor_parallel: 2\n"), "defaults.tensor_parallel (--tp-size) is not a"),
        (with_defaults("weight_quantization: declared\n"), "is not a metrale-jax serve flag"),
        (with_defaults("4: 2\n"), "must be a string"),
    ],
)
def test_schema_violations(text, needle):
    with pytest.raises(RecipeError) as e:
        parse_recipe("fam/stem", text)
    assert needle in str(e.value) and str(e.value).startswith("recipe fam/stem")


def test_malformed_yaml_names_the_line():
    with pytest.raises(RecipeError, match=r"malformed YAML at line 3: mapping values are not"):
        parse_recipe("fam/stem", 'recipe_version: "2"\nmodel: m\nruntime: a: b\n')


def test_render_refuses_other_runtimes_and_multi_node():
    with pytest.raises(RecipeError, match="runtime 'metrale'"):
        render_argv(parse_recipe("f/s", GOOD.replace("runtime: metrale-jax", "runtime: metrale")))
    with pytest.raises(RecipeError, match="needs 2 nodes"):
        render_argv(parse_recipe("f/s", GOOD + "min_nodes: 2\n"))


def test_load_recipe_ids(tmp_path):
    (tmp_path / "fam").mkdir()
    (tmp_path / "fam" / "stem.yaml").write_text(GOOD)
    assert recipe_ids(tmp_path) == ["fam/stem"]
    assert load_recipe(tmp_path, "fam/stem").model == "org/model"
    with pytest.raises(RecipeError, match="unknown recipe 'fam/other'.*known: fam/stem"):
        load_recipe(tmp_path, "fam/other")
    for bad in ("stem", "fam/../x", "a/b/c", "/fam"):
        with pytest.raises(RecipeError, match="is not FAMILY/STEM"):
            load_recipe(tmp_path, bad)


def test_serve_argv_requires_the_recipes_model(tmp_path):
    (tmp_path / "fam").mkdir()
    (tmp_path / "fam" / "stem.yaml").write_text(GOOD)
    assert serve_argv(tmp_path, "org/model", "fam/stem", v("--block-size 32"))[-2:] == v("--block-size 32")
    assert serve_argv(tmp_path, "any", None, v("--speculative")) == v("any --speculative")
    with pytest.raises(RecipeError, match="serves org/model, not --checkpoint other/model"):
        serve_argv(tmp_path, "other/model", "fam/stem", [])


# ---- the final argv, through the serve option set ----


def test_parse_serve_argv_returns_only_the_given_flags():
    model, raw = parse_serve_argv(v("m --max-seq-len 4096 --speculative --max-batch-size auto"))
    assert model == "m"
    assert raw == {"max_seq_len": 4096, "speculative": True, "max_batch_size": "auto"}


@pytest.mark.parametrize(
    "argv, needle",
    [
        ("m --foo 1", "No such option"),
        ("m --block-size x", "'x' is not a valid integer"),
        ("m --block-size", "requires an argument"),
        ("m n", "unexpected extra argument"),
        ("", "Missing argument"),
    ],
)
def test_parse_serve_argv_refusals(argv, needle):
    with pytest.raises(SettingsError) as e:
        parse_serve_argv(v(argv))
    assert len(e.value.messages) == 1 and needle in e.value.messages[0]


# ---- the shipped recipes ----

SHIPPED = recipe_ids(REPO_RECIPES_DIR)


def test_every_family_ships_a_plain_and_an_mtp_recipe():
    assert {
        "qwen3-next/qwen3-next-80b-a3b",
        "qwen3-next/qwen3-next-80b-a3b-mtp",
        "qwen3.5/qwen3.5-27b",
        "qwen3.5/qwen3.5-27b-mtp",
        "qwen3.5/qwen3.5-35b-a3b",
        "qwen3.5/qwen3.5-35b-a3b-mtp",
        "metrale-jax/tiny",
        "metrale-jax/tiny-mtp",
    } <= set(SHIPPED)


@pytest.mark.parametrize("recipe_id", SHIPPED)
def test_shipped_recipe_resolves_against_its_model(recipe_id):
    recipe = load_recipe(REPO_RECIPES_DIR, recipe_id)
    source = resolve_model(recipe.model, REPO_RECIPES_DIR)
    assert source.id == recipe.model
    model, raw = parse_serve_argv(render_argv(recipe))
    assert model == recipe.model
    behavior = load_behavior(source.model_toml)
    s = resolve_settings(raw, behavior, auto_slots=8)
    assert s.speculative == recipe_id.endswith("-mtp")
    assert "absent" not in behavior.source  # every shipped model has a MODEL.toml
    if s.speculative:
        assert source.config.num_mtp_layers >= 1


def test_tiny_mtp_takes_its_drafts_cap_and_kv_dtype_from_model_toml():
    recipe = load_recipe(REPO_RECIPES_DIR, "metrale-jax/tiny-mtp")
    source = resolve_model(recipe.model, REPO_RECIPES_DIR)
    s = resolve_settings(parse_serve_argv(render_argv(recipe))[1], load_behavior(source.model_toml), auto_slots=8)
    rules = {p.setting: p.rule for p in s.provenance}
    assert (s.num_drafts, s.mtp_max_seqs, s.kv_cache_dtype) == (3, 16, "f32")
    assert all(rules[f].startswith("MODEL.toml") for f in ("--num-drafts", "--mtp-max-seqs", "--kv-cache-dtype"))


# ---- a recipe on a local copy of its model; a hub id in the local Hugging Face cache ----

NEXT = "Qwen/Qwen3-Next-80B-A3B-Instruct"
NEXT_MTP = "qwen3-next/qwen3-next-80b-a3b-mtp"


def _plan(checkpoint: str, *extra: str):
    from click.testing import CliRunner

    from metrale_jax_cli.memory_cmd import memory

    args = ["--no-activations", "--json", "--checkpoint", checkpoint, "--device", "H200"]
    return CliRunner().invoke(memory, [*args, "--isl", "3000", "--osl", "1000", "--concurrency", "4", *extra])


def _copy(tmp_path, name: str, edit=None) -> str:
    """A download of the 80B as far as the planner reads it: its config.json (no MODEL.toml)."""
    import json

    raw = json.loads((REPO_RECIPES_DIR / "models" / NEXT / "config.json").read_text())
    if edit:
        edit(raw)
    folder = tmp_path / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return str(folder)


def test_a_recipe_plans_a_local_copy_of_its_model_with_the_recipes_model_toml(tmp_path):
    import json

    folder = _copy(tmp_path, "downloads/qwen3-next")
    src = resolve_model(folder, REPO_RECIPES_DIR, NEXT)
    assert src.id == NEXT and src.model_toml == REPO_RECIPES_DIR / "models" / NEXT / "MODEL.toml"
    assert src.config_from == f"{folder}/config.json"
    r = _plan(folder, "--recipe", NEXT_MTP)
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["checkpoint"]["id"] == NEXT and d["checkpoint"]["model_toml"] == str(src.model_toml)
    assert d["checkpoint"]["config"] == f"{folder}/config.json"
    assert resolve_model(folder, REPO_RECIPES_DIR).id == folder  # no recipe: the copy is itself


def test_a_copy_of_another_model_is_refused_by_the_recipe(tmp_path):
    folder = _copy(tmp_path, "other", edit=lambda raw: raw.update(num_hidden_layers=44))
    r = _plan(folder, "--recipe", NEXT_MTP)
    assert r.exit_code == 2 and f"serves {NEXT}, not --checkpoint {folder}" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1


def test_a_hub_id_finds_its_snapshot_in_the_hf_cache(tmp_path, monkeypatch):
    import json

    from metrale_jax.hub_cache import checkpoint_directory, find_snapshot, hub_cache_dir

    repo = tmp_path / "hub" / "models--Qwen--Qwen3-Next-80B-A3B-Instruct"
    old = _copy(repo / "snapshots", "0ld", edit=lambda raw: raw.update(num_hidden_layers=4))
    snap = _copy(repo / "snapshots", "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123\n")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert hub_cache_dir() == str(tmp_path / "hub") and find_snapshot(NEXT) == snap
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert checkpoint_directory(NEXT) == snap and checkpoint_directory("Qwen/absent") is None
    (repo / "refs" / "main").write_text("gone\n")
    assert find_snapshot(NEXT) in (old, snap) and find_snapshot("../x") is None
    (repo / "refs" / "main").write_text("abc123\n")
    r = _plan(NEXT, "--recipe", NEXT_MTP)
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["checkpoint"]["id"] == NEXT and d["checkpoint"]["config"] == f"{snap}/config.json"
    assert d["checkpoint"]["model_toml"] == str(REPO_RECIPES_DIR / "models" / NEXT / "MODEL.toml")
