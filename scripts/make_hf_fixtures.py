#!/usr/bin/env python3
"""Build golden Hugging Face reference fixtures for metrale-jax.

Run it through ``scripts/make_hf_fixtures.sh`` (which makes a Python 3.11 venv with torch and
transformers); it needs torch and transformers 5.x, never the network.

For each tiny random model this writes ``<out>/<name>/`` with

* ``config.json``        the config laid out as the released checkpoints carry it
                         (Qwen3-Next: flat ``qwen3_next``; Qwen3.5: the ``qwen3_5`` / ``qwen3_5_moe``
                         VLM wrapper with a ``text_config``),
* ``model.safetensors``  float32 weights in the *released* tensor-name layout (not what
                         ``save_pretrained`` writes), plus random ``mtp.*`` tensors (HF ignores them),
* ``golden.npz``         ``tokens`` int32 [P+N], ``prompt_len`` (P), ``logits_f32`` and
                         ``logits_bf16`` float32 [P+N, vocab].

FP8 variants (``FP8_FIXTURES``, made from their source fixture's folder): the projections the
releases convert stored e4m3 with bf16 ``weight_scale_inv`` blocks and a ``quantization_config``;
``golden.npz`` holds HF's logits on the dequantised weights (see tests/fixtures/hf/README.md).

Protocol: ONE prefill forward over the P prompt tokens with ``use_cache=True`` (its P logit rows),
then N cached single-token decode steps, each feeding the argmax of the previous row (f32 run).
The bf16 run is the same protocol on the model cast to bfloat16, fed the f32 run's tokens.

The model is built *from the config.json written here* (so file and model cannot drift apart),
its weights are drawn from numpy with a fixed seed (independent of torch's init order), and the
fixture is then validated: HF's own ``from_pretrained`` on the folder and a hand-written inverse
name mapping both give bit-identical logits, the decode rows match a no-cache full forward, and
the logits past the first 64-token chunk are finite and varied.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import (  # noqa: E402
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

# The fixtures' configs: plain dicts in the registry, which imports no jax (this venv has none).
from metrale_jax.model_registry import HF_FIXTURES  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import make_tokenizer_fixtures  # noqa: E402

PROMPT_LEN = 133  # > 2 chunks of 64: the prefill crosses two chunk boundaries of the chunked GDN
DECODE_LEN = 16

# Random-weight scales (see README): large enough that logits are spread out, small enough to stay sane.
STD_EMBED = 1.0
STD_EMBED_TIED = 0.35  # a tied embedding is also the head: keep the logits in the same range
STD_LM_HEAD = 0.3
STD_PROJ = 0.15
STD_CONV = 0.4
STD_ROUTER = 0.3
STD_NORM = 0.1  # zero-centred norms: w ~ N(0, 0.1); gated norm: w ~ 1 + N(0, 0.1)


# ---------------------------------------------------------------------------------------------
# config.json in the released layout
# ---------------------------------------------------------------------------------------------
def layer_types_of(spec: dict) -> list[str]:
    k = spec["full_attention_interval"]
    return ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(spec["num_hidden_layers"])]


def config_json(spec: dict) -> dict:
    fam = spec["family"]
    V = spec["vocab_size"]
    if fam == "qwen3_next":
        # The flat config of Qwen3-Next-80B-A3B-*: legacy top-level rope_theta / partial_rotary_factor,
        # full_attention_interval instead of layer_types. num_nextn_predict_layers is not in the HF release
        # (vLLM defaults it to 1); it is written here so our loader can read the MTP depth.
        return {
            "architectures": ["Qwen3NextForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": V - 2,
            "decoder_sparse_step": spec["decoder_sparse_step"],
            "eos_token_id": V - 1,
            "full_attention_interval": spec["full_attention_interval"],
            "head_dim": spec["head_dim"],
            "hidden_act": "silu",
            "hidden_size": spec["hidden_size"],
            "initializer_range": 0.02,
            "intermediate_size": spec["intermediate_size"],
            "linear_conv_kernel_dim": spec["linear_conv_kernel_dim"],
            "linear_key_head_dim": spec["linear_key_head_dim"],
            "linear_num_key_heads": spec["linear_num_key_heads"],
            "linear_num_value_heads": spec["linear_num_value_heads"],
            "linear_value_head_dim": spec["linear_value_head_dim"],
            "max_position_embeddings": 4096,
            "mlp_only_layers": list(spec["mlp_only_layers"]),
            "model_type": "qwen3_next",
            "moe_intermediate_size": spec["moe_intermediate_size"],
            "norm_topk_prob": spec["norm_topk_prob"],
            "num_attention_heads": spec["num_attention_heads"],
            "num_experts": spec["num_experts"],
            "num_experts_per_tok": spec["num_experts_per_tok"],
            "num_hidden_layers": spec["num_hidden_layers"],
            "num_key_value_heads": spec["num_key_value_heads"],
            "num_nextn_predict_layers": 1,
            "output_router_logits": False,
            "partial_rotary_factor": spec["partial_rotary_factor"],
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": spec["rope_theta"],
            "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": spec["shared_expert_intermediate_size"],
            "tie_word_embeddings": spec["tie_word_embeddings"],
            "torch_dtype": "float32",
            "transformers_version": transformers.__version__,
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": V,
        }

    # Qwen3.5 / Qwen3.5-MoE: the VLM wrapper config (model_type qwen3_5 / qwen3_5_moe) with the text
    # model in text_config. The released files also carry fields transformers ignores
    # (attn_output_gate, mtp_*, mamba_ssm_dtype) and both layer_types and full_attention_interval.
    moe = fam == "qwen3_5_moe"
    text = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": V - 2,
        "dtype": "float32",
        "eos_token_id": V - 1,
        "full_attention_interval": spec["full_attention_interval"],
        "head_dim": spec["head_dim"],
        "hidden_act": "silu",
        "hidden_size": spec["hidden_size"],
        "initializer_range": 0.02,
        "layer_types": layer_types_of(spec),
        "linear_conv_kernel_dim": spec["linear_conv_kernel_dim"],
        "linear_key_head_dim": spec["linear_key_head_dim"],
        "linear_num_key_heads": spec["linear_num_key_heads"],
        "linear_num_value_heads": spec["linear_num_value_heads"],
        "linear_value_head_dim": spec["linear_value_head_dim"],
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 4096,
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": spec["num_attention_heads"],
        "num_hidden_layers": spec["num_hidden_layers"],
        "num_key_value_heads": spec["num_key_value_heads"],
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": list(spec["mrope_section"]),
            "partial_rotary_factor": spec["partial_rotary_factor"],
            "rope_theta": spec["rope_theta"],
            "rope_type": "default",
        },
        "tie_word_embeddings": spec["tie_word_embeddings"],
        "use_cache": True,
        "vocab_size": V,
    }
    if moe:
        text.update(
            {
                "moe_intermediate_size": spec["moe_intermediate_size"],
                "num_experts": spec["num_experts"],
                "num_experts_per_tok": spec["num_experts_per_tok"],
                "output_router_logits": False,
                "router_aux_loss_coef": 0.001,
                "shared_expert_intermediate_size": spec["shared_expert_intermediate_size"],
            }
        )
    else:
        text["intermediate_size"] = spec["intermediate_size"]
    # The vision tower's defaults as transformers writes them; out_hidden_size = the text hidden size,
    # model_type as in the released files (transformers rewrites it to *_vision on load).
    vision = {
        "depth": 27,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 4304,
        "model_type": fam,
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": spec["hidden_size"],
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "image_token_id": 248056,
        "model_type": fam,
        "text_config": text,
        "tie_word_embeddings": spec["tie_word_embeddings"],
        "transformers_version": transformers.__version__,
        "video_token_id": 248057,
        "vision_config": vision,
        "vision_end_token_id": 248054,
        "vision_start_token_id": 248053,
    }


def model_classes(fam: str):
    return {
        "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM),
        "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM),
        "qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM),
    }[fam]


HF_KW = dict(attn_implementation="eager", experts_implementation="eager", dtype=torch.float32)


def build_model(fam: str, folder: Path):
    cfg_cls, model_cls = model_classes(fam)
    cfg = cfg_cls.from_pretrained(folder)  # from the config.json we wrote (text_config for Qwen3.5)
    model = model_cls._from_config(cfg, **HF_KW)
    model.eval()
    return model


def check_config(model, spec: dict, folder: Path) -> None:
    """The config.json, as transformers parses it, means what the spec says."""
    from transformers import AutoConfig

    cfg = model.config
    rp = cfg.rope_parameters
    assert rp["rope_type"] == "default" and rp["rope_theta"] == spec["rope_theta"], rp
    assert rp["partial_rotary_factor"] == spec["partial_rotary_factor"], rp
    assert cfg.layer_types == layer_types_of(spec), cfg.layer_types
    assert cfg.head_dim == spec["head_dim"] and cfg.vocab_size == spec["vocab_size"]
    assert cfg.tie_word_embeddings == spec["tie_word_embeddings"]
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == spec["tie_word_embeddings"]
    if "mrope_section" in spec:
        assert rp["mrope_section"] == spec["mrope_section"] and rp["mrope_interleaved"] is True
        assert model.model.rotary_emb.mrope_section == spec["mrope_section"]
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    for i, kind in enumerate(kinds):
        moe = spec.get("num_experts", 0) > 0 and i not in spec.get("mlp_only_layers", [])
        assert kind.endswith("SparseMoeBlock") == moe, (i, kinds)
    top = AutoConfig.from_pretrained(folder)  # the wrapper (Qwen3.5) or flat (Qwen3-Next) config class
    assert top.model_type == spec["family"], top.model_type
    if spec["family"] != "qwen3_next":
        assert top.text_config.layer_types == cfg.layer_types
        assert top.vision_config.out_hidden_size == spec["hidden_size"]


# ---------------------------------------------------------------------------------------------
# Random weights
# ---------------------------------------------------------------------------------------------
def random_tensor(name: str, shape: tuple[int, ...], rng: np.random.Generator, tied: bool = False) -> torch.Tensor:
    leaf = name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1]
    if name.endswith("embed_tokens.weight"):
        a = rng.normal(0.0, STD_EMBED_TIED if tied else STD_EMBED, shape)
    elif name == "lm_head.weight":
        a = rng.normal(0.0, STD_LM_HEAD, shape)
    elif name.endswith("linear_attn.norm.weight"):  # gated RMSNorm: weight applied as w (init 1)
        a = 1.0 + rng.normal(0.0, STD_NORM, shape)
    elif leaf in (
        "input_layernorm",
        "post_attention_layernorm",
        "norm",
        "q_norm",
        "k_norm",
        "pre_fc_norm_embedding",
        "pre_fc_norm_hidden",
    ):  # zero-centred (1 + w)
        a = rng.normal(0.0, STD_NORM, shape)
    elif name.endswith("A_log"):
        a = np.log(rng.uniform(0.05, 3.0, shape))
    elif name.endswith("dt_bias"):
        a = rng.normal(-1.0, 0.8, shape)
    elif name.endswith("conv1d.weight"):
        a = rng.normal(0.0, STD_CONV, shape)
    elif name.endswith("mlp.gate.weight"):  # router
        a = rng.normal(0.0, STD_ROUTER, shape)
    elif len(shape) in (2, 3):  # linear projections and fused expert tensors
        a = rng.normal(0.0, STD_PROJ, shape)
    else:
        raise ValueError(f"no randomisation rule for {name} {shape}")
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def randomize_(model, rng: np.random.Generator) -> None:
    params = dict(model.named_parameters())  # tied lm_head appears once (as embed_tokens)
    tied = "lm_head.weight" not in params
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            p.copy_(random_tensor(name, tuple(p.shape), rng, tied))


# ---------------------------------------------------------------------------------------------
# HF in-memory names  <->  released checkpoint names
# ---------------------------------------------------------------------------------------------
def hf_to_release(sd: dict[str, torch.Tensor], fam: str, tie: bool) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        t = t.detach().to(torch.float32).contiguous()
        if tie and name == "lm_head.weight":
            continue  # tied: the released file has no lm_head.weight
        if fam == "qwen3_next" and name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:].clone()
            continue
        if fam == "qwen3_next" and name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].clone()
            continue
        if fam in ("qwen3_5", "qwen3_5_moe") and name.startswith("model."):
            name = "model.language_model." + name[len("model.") :]
        out[name] = t.clone()
    return out


def release_to_hf(tensors: dict[str, torch.Tensor], fam: str, num_experts: int) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    experts: dict[str, dict] = {}
    for name, t in tensors.items():
        if name.startswith("mtp."):
            continue
        if fam in ("qwen3_5", "qwen3_5_moe") and name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model.") :]
        if fam == "qwen3_next" and ".mlp.experts." in name:
            base, rest = name.split(".mlp.experts.")
            e, proj = rest.split(".")[:2]
            experts.setdefault(base, {})[(int(e), proj)] = t
            continue
        sd[name] = t
    for base, d in experts.items():
        gate_up = [torch.cat([d[(e, "gate_proj")], d[(e, "up_proj")]], 0) for e in range(num_experts)]
        sd[f"{base}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        sd[f"{base}.mlp.experts.down_proj"] = torch.stack([d[(e, "down_proj")] for e in range(num_experts)])
    return sd


def mtp_tensors(release: dict[str, torch.Tensor], spec: dict, rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """mtp.* = fc, two pre-fc norms, one full-attention decoder layer (same suffixes and MLP kind as the
    trunk's full-attention MoE layers), final norm. Shapes copied from a trunk layer of that kind."""
    fam = spec["family"]
    prefix = "model.layers." if fam == "qwen3_next" else "model.language_model.layers."
    types = layer_types_of(spec)
    moe = spec.get("num_experts", 0) > 0
    mlp_only = spec.get("mlp_only_layers", [])
    src = next(i for i, t in enumerate(types) if t == "full_attention" and (not moe or i not in mlp_only))
    hd = spec["hidden_size"]
    shapes = {
        "mtp.fc.weight": (hd, 2 * hd),
        "mtp.pre_fc_norm_embedding.weight": (hd,),
        "mtp.pre_fc_norm_hidden.weight": (hd,),
        "mtp.norm.weight": (hd,),
    }
    lp = f"{prefix}{src}."
    for name, t in release.items():
        if name.startswith(lp):
            shapes["mtp.layers.0." + name[len(lp) :]] = tuple(t.shape)
    return {name: random_tensor(name, shape, rng) for name, shape in sorted(shapes.items())}


# ---------------------------------------------------------------------------------------------
# The golden protocol
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def run_protocol(model, prompt: np.ndarray, n_decode: int, feed: np.ndarray | None = None):
    """Prefill (use_cache=True) then n_decode cached single-token steps. Feeds argmax (greedy) unless
    `feed` (the full token sequence) is given. Returns (logits float32 [P+N, V], tokens int64 [P+N])."""
    ids = torch.from_numpy(prompt.astype(np.int64))[None]
    out = model(input_ids=ids, use_cache=True)
    cache = out.cache
    rows = [out.logits[0].float()]
    tokens = list(prompt.tolist())
    for j in range(n_decode):
        if feed is None:
            nxt = int(torch.argmax(rows[-1][-1]).item())
        else:
            nxt = int(feed[len(prompt) + j])
        tokens.append(nxt)
        out = model(input_ids=torch.tensor([[nxt]]), cache=cache, use_cache=True)
        cache = out.cache
        rows.append(out.logits[0].float())
    return torch.cat(rows, 0).numpy().astype(np.float32), np.asarray(tokens, dtype=np.int64)


def write_golden(model, spec: dict, folder: Path) -> tuple[np.ndarray, np.ndarray]:
    """The protocol on the spec's prompt in float32 (greedy) and in bf16 (fed the f32 tokens), written
    to `folder`/golden.npz. Returns (logits_f32, logits_bf16), both float32 [P+N, V]."""
    prompt = np.random.default_rng(spec["seed"] + 7).integers(0, spec["vocab_size"], PROMPT_LEN)
    logits_f32, tokens = run_protocol(model, prompt, DECODE_LEN)
    logits_bf16, tokens_b = run_protocol(to_bf16(model), prompt, DECODE_LEN, feed=tokens)
    assert np.array_equal(tokens, tokens_b)
    np.savez_compressed(
        folder / "golden.npz",
        tokens=tokens.astype(np.int32),
        prompt_len=np.int32(PROMPT_LEN),
        logits_f32=logits_f32,
        logits_bf16=logits_bf16.astype(np.float32),
    )
    return logits_f32, logits_bf16


def to_bf16(model):
    """The model as `from_pretrained(..., dtype=torch.bfloat16)` gives it: every parameter bf16 (A_log,
    dt_bias and the norm weights included: these models keep nothing in fp32), while the rotary
    inv_freq buffers stay float32 (a plain `.to(bfloat16)` would round them too)."""
    m = copy.deepcopy(model).to(torch.bfloat16)
    ref = dict(model.named_buffers())
    for n, b in m.named_buffers():
        b.data = ref[n].clone()
    return m


def rehome_(model) -> None:
    """from_pretrained leaves parameters as views into the safetensors buffer (8-byte aligned); the CPU
    GEMV kernels then take another path and decode rows round differently. Copy them to fresh storage."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()


@torch.no_grad()
def full_forward(model, tokens: np.ndarray) -> np.ndarray:
    ids = torch.from_numpy(tokens.astype(np.int64))[None]
    return model(input_ids=ids, use_cache=False).logits[0].float().numpy()


def top2_gap(logits: np.ndarray) -> float:
    s = np.sort(logits, axis=-1)
    return float((s[:, -1] - s[:, -2]).min())


# ---------------------------------------------------------------------------------------------
def make_fixture(name: str, spec: dict, out_root: Path, validate: bool) -> dict:
    t0 = time.time()
    fam = spec["family"]
    folder = out_root / name
    folder.mkdir(parents=True, exist_ok=True)
    for stale in ("config.json", "model.safetensors", "golden.npz"):
        (folder / stale).unlink(missing_ok=True)
    with open(folder / "config.json", "w") as f:
        json.dump(config_json(spec), f, indent=2, sort_keys=True)
        f.write("\n")

    torch.manual_seed(spec["seed"])
    model = build_model(fam, folder)
    rng = np.random.default_rng(spec["seed"])
    randomize_(model, rng)
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    if spec.get("num_experts", 0) > 0:
        assert model.config._experts_implementation == "eager", model.config._experts_implementation
    tie = spec["tie_word_embeddings"]
    check_config(model, spec, folder)

    logits_f32, logits_bf16 = write_golden(model, spec, folder)
    # The rows whose argmax chose a decode token must not be near-ties.
    assert top2_gap(logits_f32[PROMPT_LEN - 1 : -1]) > 0.1, f"{name}: near-tie greedy choice; change seed"

    release = hf_to_release(model.state_dict(), fam, tie)
    release.update(mtp_tensors(release, spec, rng))
    save_file(release, str(folder / "model.safetensors"), metadata={"format": "pt"})

    stats = {
        "name": name,
        "max_abs_logit_f32": float(np.abs(logits_f32).max()),
        "max_abs_logit_bf16": float(np.abs(logits_bf16).max()),
        "max_abs_diff_bf16_vs_f32": float(np.abs(logits_bf16 - logits_f32).max()),
        "argmax_agree_bf16": float((logits_bf16.argmax(-1) == logits_f32.argmax(-1)).mean()),
        "min_top2_gap_f32_all_rows": top2_gap(logits_f32),
        "min_top2_gap_f32_greedy_rows": top2_gap(logits_f32[PROMPT_LEN - 1 : -1]),
        "n_tensors": len(release),
        "n_params": int(sum(t.numel() for t in release.values())),
    }
    if validate:
        stats.update(validate_fixture(name, spec, folder, model))
    stats["seconds"] = round(time.time() - t0, 2)
    return stats


def validate_fixture(name: str, spec: dict, folder: Path, model) -> dict:
    fam = spec["family"]
    P = PROMPT_LEN
    g = np.load(folder / "golden.npz")
    assert g["tokens"].dtype == np.int32 and g["tokens"].shape == (P + DECODE_LEN,)
    assert int(g["prompt_len"]) == P
    V = spec["vocab_size"]
    for k in ("logits_f32", "logits_bf16"):
        assert g[k].dtype == np.float32 and g[k].shape == (P + DECODE_LEN, V), (k, g[k].shape)
    prompt = g["tokens"][:P].astype(np.int64)

    # (1) HF's own loader on the released layout (conversion mapping, prefix change, mtp.* ignored).
    _, model_cls = model_classes(fam)
    hf = model_cls.from_pretrained(folder, **HF_KW).eval()
    rehome_(hf)
    ref_sd = model.state_dict()
    hf_sd = hf.state_dict()
    assert set(ref_sd) == set(hf_sd), set(ref_sd) ^ set(hf_sd)
    for k in ref_sd:
        assert torch.equal(ref_sd[k], hf_sd[k]), f"{name}: from_pretrained differs at {k}"
    lf, tok = run_protocol(hf, prompt, DECODE_LEN)
    assert np.array_equal(tok, g["tokens"]) and np.array_equal(lf, g["logits_f32"]), f"{name}: reload f32"
    hf16 = model_cls.from_pretrained(folder, **{**HF_KW, "dtype": torch.bfloat16}).eval()
    rehome_(hf16)
    assert all(p.dtype == torch.bfloat16 for p in hf16.parameters())
    assert all(b.dtype == torch.float32 for b in hf16.buffers())
    lb, _ = run_protocol(hf16, prompt, DECODE_LEN, feed=g["tokens"])
    assert np.array_equal(lb, g["logits_bf16"]), f"{name}: bf16 from_pretrained"

    # (2) hand-written inverse of the release naming, strict load into a fresh model.
    fresh = build_model(fam, folder)
    with safe_open(folder / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert any(k.startswith("mtp.") for k in tensors)
    sd = release_to_hf(tensors, fam, spec.get("num_experts", 0))
    missing, unexpected = fresh.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= ({"lm_head.weight"} if spec["tie_word_embeddings"] else set()), missing
    lf2, _ = run_protocol(fresh, prompt, DECODE_LEN)
    assert np.array_equal(lf2, g["logits_f32"]), f"{name}: manual reload"

    # (3) cached decode vs one no-cache forward over all P+N tokens (chunked path everywhere).
    full = full_forward(model, g["tokens"])
    diff_nocache = float(np.abs(full - g["logits_f32"]).max())
    diff_nocache_decode = float(np.abs(full[P:] - g["logits_f32"][P:]).max())
    assert diff_nocache < 5e-5, f"{name}: cache vs no-cache {diff_nocache}"

    # (3b) the f32 noise floor: the same forward in float64 (rope angles still from f32 inv_freq).
    m64 = build_model(fam, folder).double()
    m64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    f64 = full_forward(m64, g["tokens"])
    diff_f64 = float(np.abs(f64 - g["logits_f32"]).max())
    diff_f64_bf16 = float(np.abs(f64 - g["logits_bf16"]).max())

    # (4) rows past the first chunk (>= 64) finite and varied.
    tail = g["logits_f32"][64:]
    assert np.isfinite(g["logits_f32"]).all() and np.isfinite(g["logits_bf16"]).all()
    row_std = tail.std(-1)
    assert row_std.min() > 0.3, f"{name}: flat rows {row_std.min()}"
    assert np.abs(np.diff(tail, axis=0)).max(-1).min() > 1e-2, f"{name}: repeated rows"
    n_distinct = len(set(tail.argmax(-1).tolist()))
    assert n_distinct >= 10, f"{name}: only {n_distinct} distinct argmaxes"
    return {
        "max_abs_diff_cache_vs_nocache": diff_nocache,
        "max_abs_diff_cache_vs_nocache_decode_rows": diff_nocache_decode,
        "max_abs_diff_f32_golden_vs_f64": diff_f64,
        "max_abs_diff_bf16_golden_vs_f64": diff_f64_bf16,
        "min_row_std_pos_ge_64": float(row_std.min()),
        "distinct_argmax_pos_ge_64": n_distinct,
        "validated": True,
    }


# ---------------------------------------------------------------------------------------------
# FP8 block-scaled variants (quant_method fp8, as the -FP8 releases ship them)
# ---------------------------------------------------------------------------------------------
#: FP8 fixture -> the fixture it quantises and its block size. The fixtures' matrices are
#: 64-192 wide, so their blocks are 32x32 (the releases' are 128x128): each weight has several
#: blocks, partial blocks at its edges, and stacked parts that do not start on a block.
FP8_FIXTURES = {"qwen3_5_dense_fp8": ("qwen3_5_dense", 32), "qwen3_next_moe_fp8": ("qwen3_next_moe", 32)}
#: Released tensors kept at full precision (as the releases' modules_to_not_convert say): every
#: 1-D or conv tensor, the embedding and head, the router and shared-expert gate, the GDN's
#: narrow b/a projections, mtp.fc.
FP8_KEEP = (
    "embed_tokens",
    "lm_head",
    "mlp.gate.",
    "shared_expert_gate",
    "in_proj_ba",
    "in_proj_a.",
    "in_proj_b.",
    "mtp.fc",
)
FP8_MAX = 448.0


def quantise_fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] f32 -> (e4m3 values [out, in], bf16 weight_scale_inv [ceil(out/b), ceil(in/b)]),
    w ≈ values · scale_inv per block: scale_inv = absmax / 448 rounded to bf16, values = w / it
    clamped to ±448 and rounded to nearest even by the cast."""
    rows, cols = w.shape
    pr, pc = -rows % block, -cols % block
    padded = torch.nn.functional.pad(w, (0, pc, 0, pr))
    blocks = padded.reshape(padded.shape[0] // block, block, padded.shape[1] // block, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-10)
    scale = (amax / FP8_MAX).to(torch.bfloat16)
    full = scale.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    values = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values, scale


def dequantise_fp8(values: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    rows, cols = values.shape
    full = scale.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return values.float() * full


def make_fp8_fixture(name: str, out_root: Path) -> dict:
    """Quantise fixture `src` to FP8 (`FP8_FIXTURES`), write it in the release layout with its
    quantization_config, and record HF's logits on the dequantised weights (the protocol above)."""
    t0 = time.time()
    src, block = FP8_FIXTURES[name]
    spec = HF_FIXTURES[src]
    fam = spec["family"]
    folder = out_root / name
    folder.mkdir(parents=True, exist_ok=True)
    with safe_open(str(out_root / src / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    stored, dequantised, kept = {}, {}, set()
    for k, t in sorted(tensors.items()):
        if (
            t.ndim == 2
            and k.endswith(".weight")
            and not any(m in k for m in FP8_KEEP)
            and "norm" not in k
            and "conv1d" not in k
        ):
            values, scale = quantise_fp8(t, block)
            stored[k], stored[k + "_scale_inv"] = values, scale
            dequantised[k] = dequantise_fp8(values, scale, block)
        else:
            stored[k] = dequantised[k] = t
            if t.ndim == 2 and k.endswith(".weight") and "norm" not in k:
                kept.add(k[: -len(".weight")])
    config = json.loads((out_root / src / "config.json").read_text())
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [block, block],
        "modules_to_not_convert": sorted(kept),
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(stored, str(folder / "model.safetensors"), metadata={"format": "pt"})

    model = build_model(fam, out_root / src)
    missing, unexpected = model.load_state_dict(
        release_to_hf(dequantised, fam, spec.get("num_experts", 0)), strict=False
    )
    assert not unexpected and all(m == "lm_head.weight" for m in missing), (missing, unexpected)
    if spec["tie_word_embeddings"]:
        model.tie_weights()
    logits_f32, _ = write_golden(model, spec, folder)
    src_golden = np.load(out_root / src / "golden.npz")["logits_f32"]
    return {
        "name": name,
        "fp8_tensors": sum(1 for t in stored.values() if t.dtype == torch.float8_e4m3fn),
        "kept_modules": len(kept),
        "max_abs_diff_vs_unquantised_f32": float(np.abs(logits_f32 - src_golden).max()),
        "max_abs_logit_f32": float(np.abs(logits_f32).max()),
        "seconds": round(time.time() - t0, 2),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="tests/fixtures/hf", type=Path)
    ap.add_argument("--only", nargs="*", default=None, help="fixture names (default: all)")
    ap.add_argument("--no-validate", action="store_true")
    args = ap.parse_args(argv)

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)  # fixed reduction order: reruns give the same bytes
    torch.use_deterministic_algorithms(True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, numpy {np.__version__}")
    names = args.only or [*HF_FIXTURES, *FP8_FIXTURES]
    t0 = time.time()
    all_stats = []
    for name in names:
        if name in FP8_FIXTURES:
            st = make_fp8_fixture(name, args.out)
        else:
            st = make_fixture(name, HF_FIXTURES[name], args.out, validate=not args.no_validate)
        all_stats.append(st)
        print(json.dumps(st))
    if args.only is None or "qwen3_5_dense" in args.only:  # the tokenizer fixtures (HF's ids, chat text, greedy chat)
        make_tokenizer_fixtures.main(["--chat-model", str(args.out / "qwen3_5_dense")])
    total = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"done in {time.time() - t0:.1f}s; {args.out} holds {total / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
