"""Model configuration of the Qwen3-Next / Qwen3.5 hybrid family, read from a Hugging Face config.json.

Owns: `ModelConfig` (frozen, hashable, so it is a static argument under jit) and the translation
of the three HF model types (`qwen3_next`, `qwen3_5_text`, `qwen3_5_moe_text`, plus the multimodal
wrappers `qwen3_5` / `qwen3_5_moe` whose `text_config` holds the language model) into it.

Invariants:
- Every field that changes the math is explicit here, with HF's default where HF has one
  (transformers 5.x `Qwen3NextConfig` / `Qwen3_5TextConfig` / `Qwen3_5MoeTextConfig`).
- Unknown model types and missing required fields raise `ConfigError` naming them; nothing is
  guessed silently.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from metrale_jax.errors import MetraleError

LINEAR = "linear_attention"
FULL = "full_attention"

_SUPPORTED = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
_WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


class ConfigError(MetraleError, ValueError):
    """A config.json that does not describe a model this package can run."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The hybrid model's architecture. All fields are plain Python values (hashable)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    num_mtp_layers: int = 0
    # The MTP head reads the trunk's hidden after the final norm (vLLM, SGLang); False feeds the
    # pre-norm hidden (what some ports did; kept as a switch for A/B studies and the diff's
    # planted-bug control).
    mtp_hidden_postnorm: bool = True
    # How the checkpoint names GDN projections and experts: "qwen3_next" (fused, interleaved
    # in_proj_qkvz / in_proj_ba; per-expert tensors) or "qwen3_5" (split in_proj_qkv/z/b/a;
    # fused experts) — only the loader reads it.
    weight_layout: str = "qwen3_next"
    # The checkpoint prefix of the text trunk: "model" or "model.language_model".
    trunk_prefix: str = "model"

    def __post_init__(self):
        problems = []
        if len(self.layer_types) != self.num_hidden_layers:
            problems.append(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        bad = sorted({t for t in self.layer_types if t not in (LINEAR, FULL)})
        if bad:
            problems.append(f"unknown layer types {bad}")
        if self.num_attention_heads % max(self.num_key_value_heads, 1):
            problems.append("num_attention_heads is not a multiple of num_key_value_heads")
        if self.linear_num_value_heads % max(self.linear_num_key_heads, 1):
            problems.append("linear_num_value_heads is not a multiple of linear_num_key_heads")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            problems.append("num_experts_per_tok must be in 1..num_experts")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            problems.append(f"rotary dim {self.rotary_dim} must be even and at most head_dim")
        if problems:
            raise ConfigError("; ".join(problems))

    # ---- derived sizes (one place) ----
    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def num_linear_layers(self) -> int:
        return len(self.linear_layer_ids)

    @property
    def num_full_layers(self) -> int:
        return len(self.full_layer_ids)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, i: int) -> bool:
        """HF's rule: sparse MoE unless listed dense, experts exist, and the sparse step hits."""
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0

    @property
    def mtp_is_moe(self) -> bool:
        """The MTP layer is built as layer index 0 (vLLM), so it follows layer 0's MLP rule."""
        return self.num_experts > 0 and 0 not in self.mlp_only_layers

    def replace(self, **kw) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dict in Qwen3-Next (flat) form that `from_hf_dict` reads back equal."""
        d = {
            "model_type": self.model_type,
            "architectures": ["Qwen3NextForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "layer_types": list(self.layer_types),
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
            },
            "attention_bias": self.attention_bias,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": self.decoder_sparse_step,
            "mlp_only_layers": list(self.mlp_only_layers),
            "tie_word_embeddings": self.tie_word_embeddings,
            "num_nextn_predict_layers": self.num_mtp_layers,
            "hidden_act": "silu",
        }
        if not self.mtp_hidden_postnorm:
            d["mtp_hidden_postnorm"] = False
        if self.trunk_prefix == "model.language_model":
            # Qwen3.5 releases wrap the text model in a multimodal config.
            wrapper = {v: k for k, v in _WRAPPERS.items()}[self.model_type]
            d["mtp_num_hidden_layers"] = d.pop("num_nextn_predict_layers")
            d["architectures"] = ["Qwen3_5ForConditionalGeneration"]
            return {"model_type": wrapper, "text_config": d, "tie_word_embeddings": self.tie_word_embeddings}
        return d


def _require(d: Mapping[str, Any], key: str, missing: list[str]):
    if key not in d:
        missing.append(key)
        return None
    return d[key]


def from_hf_dict(raw: Mapping[str, Any]) -> ModelConfig:
    """Translate an HF config.json dict (flat or multimodal wrapper) into a `ModelConfig`.

    Raises `ConfigError` for an unknown model type or missing required fields (all listed).
    """
    mt = raw.get("model_type")
    outer = raw
    if mt in _WRAPPERS:
        if "text_config" not in raw:
            raise ConfigError(f"config of model_type {mt!r} has no text_config")
        d: dict[str, Any] = dict(raw["text_config"])
        d.setdefault("model_type", _WRAPPERS[mt])
        mt = d["model_type"]
        layout, prefix = "qwen3_5", "model.language_model"
    else:
        d = dict(raw)
        layout = "qwen3_5" if mt in ("qwen3_5_text", "qwen3_5_moe_text") else "qwen3_next"
        prefix = "model"
    if mt not in _SUPPORTED:
        raise ConfigError(f"unsupported model_type {mt!r} (supported: {', '.join(_SUPPORTED + tuple(_WRAPPERS))})")
    missing: list[str] = []
    vocab = _require(d, "vocab_size", missing)
    hidden = _require(d, "hidden_size", missing)
    n_layers = _require(d, "num_hidden_layers", missing)
    heads = _require(d, "num_attention_heads", missing)
    if missing:
        raise ConfigError(f"config.json lacks required field(s): {', '.join(missing)}")

    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    prf = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))

    layer_types = d.get("layer_types")
    if layer_types is None:
        interval = int(d.get("full_attention_interval", 4))
        layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers)]

    is_moe_type = mt in ("qwen3_next", "qwen3_5_moe_text")
    num_experts = int(d.get("num_experts", 512 if mt == "qwen3_next" else 0)) if is_moe_type else 0
    if mt == "qwen3_5_moe_text":
        num_experts = int(d.get("num_experts", 256))
    defaults_heads = {"qwen3_next": 2, "qwen3_5_text": 4, "qwen3_5_moe_text": 2}
    num_mtp = d.get("num_nextn_predict_layers", d.get("mtp_num_hidden_layers", 0))
    tie = raw.get("tie_word_embeddings", d.get("tie_word_embeddings", False))
    if "tie_word_embeddings" in d:
        tie = d["tie_word_embeddings"]
    return ModelConfig(
        model_type=mt,
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(d.get("intermediate_size", 5632)),
        num_hidden_layers=int(n_layers),
        num_attention_heads=int(heads),
        num_key_value_heads=int(d.get("num_key_value_heads", defaults_heads[mt])),
        head_dim=int(d.get("head_dim", 256)),
        layer_types=tuple(layer_types),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        partial_rotary_factor=float(prf),
        attention_bias=bool(d.get("attention_bias", False)),
        linear_conv_kernel_dim=int(d.get("linear_conv_kernel_dim", 4)),
        linear_key_head_dim=int(d.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(d.get("linear_value_head_dim", 128)),
        linear_num_key_heads=int(d.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(d.get("linear_num_value_heads", 32)),
        num_experts=num_experts,
        num_experts_per_tok=int(d.get("num_experts_per_tok", 10 if mt == "qwen3_next" else 8)) if num_experts else 0,
        moe_intermediate_size=int(d.get("moe_intermediate_size", 512)) if num_experts else 0,
        shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size", 512)) if num_experts else 0,
        # Qwen3.5-MoE always renormalises the top-k.
        norm_topk_prob=bool(d.get("norm_topk_prob", True)) if mt == "qwen3_next" else True,
        decoder_sparse_step=int(d.get("decoder_sparse_step", 1)) if mt == "qwen3_next" else 1,
        mlp_only_layers=tuple(d.get("mlp_only_layers") or ()) if mt == "qwen3_next" else (),
        tie_word_embeddings=bool(tie),
        num_mtp_layers=int(num_mtp or 0),
        mtp_hidden_postnorm=bool(d.get("mtp_hidden_postnorm", outer.get("mtp_hidden_postnorm", True))),
        weight_layout=layout,
        trunk_prefix=prefix,
    )


def load_model_config(source: str | os.PathLike | Mapping[str, Any]) -> ModelConfig:
    """Read a config from a dict, a config.json path, or a checkpoint directory holding one."""
    if isinstance(source, Mapping):
        return from_hf_dict(source)
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"no config.json at {path}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    return from_hf_dict(raw)
