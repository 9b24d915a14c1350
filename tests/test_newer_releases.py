"""Newer releases of the Qwen3.5 architecture (Qwen3.6, Qwen3.8-27B): their config.json files load
through the path a download takes, match the reference layout, and their recipes plan.

Contract (`shared/reference/released_checkpoints.md` §1, §3): a newer release is "the same
architecture" as Qwen3.5: the multimodal wrapper (`Qwen3_5ForConditionalGeneration` /
`Qwen3_5MoeForConditionalGeneration`, `model_type` `qwen3_5` / `qwen3_5_moe`, an `image_token_id`,
a `vision_config`, the language model in `text_config` of model type `qwen3_5_text` /
`qwen3_5_moe_text`), layers [linear x 3, full] repeated, 256-wide attention heads with an output
gate, 128-wide GDN heads, vocabulary 248,320, one MTP layer; FP8 releases declare e4m3 with
128 x 128 block scales, dynamic activations and their kept modules. Each release's `ModelConfig`
equals its Qwen3.5 sibling's (the sizes the reference leaves to each release's own config).

Each config is placed as the Hugging Face cache holds a download (`models--Org--Name/snapshots/`,
`refs/main`), so the hub id resolves as a user's does, and `metrale-jax memory --recipe` plans it
with the recipe's MODEL.toml (weights from the config: no tensors on disk)."""

from __future__ import annotations

import json
import shutil

import pytest

from metrale_jax.config import FULL, LINEAR, load_model_config
from metrale_jax.memory.source import resolve_model
from metrale_jax.quantization import read_quantization
from metrale_jax_cli.recipes import REPO_RECIPES_DIR

#: (model id, recipe, its Qwen3.5 sibling, quantisation method or None)
RELEASES = (
    ("Qwen/Qwen3.6-27B-FP8", "qwen3.6/qwen3.6-27b-fp8-mtp", "Qwen/Qwen3.5-27B", "fp8"),
    ("Qwen/Qwen3.6-35B-A3B-FP8", "qwen3.6/qwen3.6-35b-a3b-fp8-mtp", "Qwen/Qwen3.5-35B-A3B", "fp8"),
    ("nvidia/Qwen3.6-35B-A3B-NVFP4", "qwen3.6/qwen3.6-35b-a3b-nvfp4-mtp", "Qwen/Qwen3.5-35B-A3B", "nvfp4"),
    ("Qwen/Qwen3.8-27B", "qwen3.8/qwen3.8-27b-mtp", "Qwen/Qwen3.5-27B", None),
)
IDS = [r[0] for r in RELEASES]
#: The FP8 releases' kept modules (§3) that are projections in this engine's terms.
FP8_KEPT = {"lm_head", "mtp.fc", "model.visual", "in_proj_a", "in_proj_b", "mlp.gate", "mlp.shared_expert_gate"}


def _download(tmp_path, model_id: str) -> str:
    """`model_id`'s shipped config files, laid out as a Hugging Face cache snapshot under
    `tmp_path/hub`; returns the snapshot directory."""
    repo = tmp_path / "hub" / f"models--{model_id.replace('/', '--')}"
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    for f in (REPO_RECIPES_DIR / "models" / model_id).iterdir():
        if f.suffix == ".json":
            shutil.copy(f, snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd\n")
    return str(snap)


@pytest.mark.parametrize(("model_id", "recipe", "sibling", "method"), RELEASES, ids=IDS)
def test_a_newer_release_config_loads_as_the_reference_layout(tmp_path, model_id, recipe, sibling, method):
    snap = _download(tmp_path, model_id)
    raw = json.loads((REPO_RECIPES_DIR / "models" / model_id / "config.json").read_text())
    moe = "A3B" in model_id
    assert raw["architectures"] == [f"Qwen3_5{'Moe' if moe else ''}ForConditionalGeneration"]
    assert raw["model_type"] == ("qwen3_5_moe" if moe else "qwen3_5")
    assert isinstance(raw["image_token_id"], int) and raw["vision_config"]["out_hidden_size"] > 0
    cfg = load_model_config(snap)
    assert cfg.model_type == ("qwen3_5_moe_text" if moe else "qwen3_5_text")
    assert cfg.trunk_prefix == "model.language_model" and cfg.weight_layout == "qwen3_5"
    assert cfg.layer_types == (LINEAR, LINEAR, LINEAR, FULL) * (cfg.num_hidden_layers // 4)
    assert (cfg.head_dim, cfg.linear_key_head_dim, cfg.linear_value_head_dim) == (256, 128, 128)
    assert (cfg.vocab_size, cfg.num_mtp_layers, cfg.linear_conv_kernel_dim) == (248_320, 1, 4)
    assert (cfg.rope_theta, cfg.partial_rotary_factor) == (1e7, 0.25)
    assert bool(cfg.num_experts) == moe
    assert cfg == load_model_config(REPO_RECIPES_DIR / "models" / sibling)
    q = read_quantization(snap, raw)
    assert (q and q.method) == method
    if method == "fp8":
        assert q is not None and q.block == (128, 128) and set(q.keep) == FP8_KEPT
        assert raw["quantization_config"]["activation_scheme"] == "dynamic"


def _plan(checkpoint: str, *recipe: str) -> dict:
    from click.testing import CliRunner

    from metrale_jax_cli.memory_cmd import memory

    argv = ["--checkpoint", checkpoint, *recipe, "--device", "H200", "--no-activations", "--json"]
    r = CliRunner().invoke(memory, [*argv, "--isl", "4096", "--osl", "1024", "--concurrency", "2"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _weight_bytes(plan: dict) -> int:
    return sum(row["bytes"] for row in plan["weights"])


@pytest.mark.parametrize(("model_id", "recipe", "sibling", "method"), RELEASES, ids=IDS)
def test_a_newer_release_recipe_plans_its_download(tmp_path, monkeypatch, model_id, recipe, sibling, method):
    """By hub id (found in the HF cache) and by the snapshot's path, the recipe's MODEL.toml
    applies, and a quantised release weighs what its format says against the bf16 sibling."""
    snap = _download(tmp_path, model_id)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model(model_id, REPO_RECIPES_DIR).config_from == f"{snap}/config.json"
    toml = str(REPO_RECIPES_DIR / "models" / model_id / "MODEL.toml")
    plans = [_plan(checkpoint, "--recipe", recipe) for checkpoint in (model_id, snap)]
    for plan in plans:
        assert plan["checkpoint"]["id"] == model_id and plan["checkpoint"]["model_toml"] == toml
        assert plan["totals"]["fits"]
    assert plans[0]["weights"] == plans[1]["weights"]
    ratio = _weight_bytes(plans[0]) / _weight_bytes(_plan(sibling))
    if method is None:
        assert ratio == 1
    else:  # projections at 1 (fp8) or ~0.56 (nvfp4) bytes a value where bf16 has 2; the rest kept
        assert 0.25 < ratio < 0.6, ratio
