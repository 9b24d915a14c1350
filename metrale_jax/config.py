"""Model configuration of the Qwen3-Next / Qwen3.5 hybrid family, read from a Hugging Face config.json.

Owns: `ModelConfig` (frozen, hashable, so it is a static argument under jit) and the translation
of the three HF model types (`qwen3_next`, `qwen3_5_text`, `qwen3_5_moe_text`, plus the multimodal
wrappers `qwen3_5` / `qwen3_5_moe` whose `text_config` holds the language model) into it.

Invariants:
- Every field that changes the math is explicit here, with HF's default where HF has one
  (transformers 5.x `Qwen3NextConfig` / `Qwen3_5TextConfig` / `Qwen3_5MoeTextConfig`).
- Unknown model types and missing required fields raise `ConfigError` naming them; nothing is
  guessed silently.
- A config is untrusted input: every field is type-checked (integers are JSON integers, flags
  JSON booleans, numbers finite, nested tables objects) and range-checked (sizes positive,
  counts non-negative, divisibility, experts per token, layer indices, the rotary width) before a
  `ModelConfig` exists; each stage reports every problem it found in one `ConfigError` line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from metrale_jax.errors import MetraleError

LINEAR = "linear_attention"
FULL = "full_attention"

_SUPPORTED = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
_WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


#: Fields that are counts or sizes of at least one; `_NON_NEGATIVE` may be zero.
_POSITIVE = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "decoder_sparse_step",
)
#: The most layers, experts or MTP layers a config may name: each count becomes Python lists of
#: that length (layer types, parameter specs, per-expert tensor names) before any check of the
#: weights, and the largest releases of the family hold 60 layers and 512 experts.
MAX_COUNT = 4096
_COUNTS = ("num_hidden_layers", "num_experts", "num_mtp_layers")
_NON_NEGATIVE = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "num_mtp_layers",
)


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
    # `diff --vocab-stress`: the head moves a third of the argmaxes onto id 0 and a third onto the
    # last id (`trunk.stress_edges`), so value-gated paths run; never read from a checkpoint.
    vocab_stress: bool = False

    def __post_init__(self):
        problems = [
            f"{k} must be a positive integer, got {getattr(self, k)!r}" for k in _POSITIVE if getattr(self, k) < 1
        ]
        problems += [f"{k} must be >= 0, got {getattr(self, k)!r}" for k in _NON_NEGATIVE if getattr(self, k) < 0]
        problems += [f"{k} {getattr(self, k)} is over {MAX_COUNT}" for k in _COUNTS if getattr(self, k) > MAX_COUNT]
        problems += [f"{k} {getattr(self, k)} is over 2**31 - 1" for k in _POSITIVE if getattr(self, k) >= 2**31]
        if problems:  # the relations below divide by these
            raise ConfigError("; ".join(problems))
        if len(self.layer_types) != self.num_hidden_layers:
            problems.append(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        bad = sorted({t for t in self.layer_types if t not in (LINEAR, FULL)})
        if bad:
            problems.append(f"unknown layer types {bad}")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads is not a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            problems.append("linear_num_value_heads is not a multiple of linear_num_key_heads")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            problems.append(
                f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..num_experts {self.num_experts}"
            )
        if self.num_experts and self.moe_intermediate_size < 1:
            problems.append(f"moe_intermediate_size must be a positive integer, got {self.moe_intermediate_size}")
        outside = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if outside:
            problems.append(f"mlp_only_layers {list(outside)} are not layer indices 0..{self.num_hidden_layers - 1}")
        for k in ("rms_norm_eps", "rope_theta"):
            if not getattr(self, k) > 0:
                problems.append(f"{k} must be > 0, got {getattr(self, k)}")
        if not 0 < self.partial_rotary_factor <= 1:
            problems.append(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        elif self.rotary_width > self.head_dim:
            problems.append(
                f"rotary dim {self.rotary_dim} rotates {self.rotary_width} channels, over head_dim {self.head_dim}"
            )
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
        """HF's `int(head_dim * partial_rotary_factor)`: the frequencies are `theta^(-2i / rotary_dim)`
        for the even i below it."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rotary_width(self) -> int:
        """Channels that rotate: two per frequency, so an odd `rotary_dim` rotates one more (HF)."""
        return 2 * ((self.rotary_dim + 1) // 2)

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


_MISSING: Any = object()
#: The largest finite float64: a JSON number past it (an integer too big for a float) is refused.
_FLOAT_MAX = sys.float_info.max


def _short(value: Any) -> str:
    """`repr(value)`, cut to 40 characters (a message stays one readable line)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class _Fields:
    """Typed reads of one config table, every problem collected (`problems`), never raised.

    A read returns the value (the default when the key is absent) or, for a value of the wrong
    type, the default with a problem recorded; `null` is a wrong type except where HF itself
    reads it as absent (`or_none=True`). Ranges and relations are `ModelConfig`'s checks."""

    def __init__(self, table: Mapping[str, Any], where: str):
        self.table, self.where = table, where
        self.problems: list[str] = []
        self.missing: list[str] = []

    def _get(self, key: str, default: Any, or_none: bool) -> Any:
        if key not in self.table or (or_none and self.table[key] is None):
            if default is _MISSING:
                self.missing.append(key)
            return default
        return self.table[key]

    def _wrong(self, key: str, what: str, default: Any) -> Any:
        self.problems.append(f"{self.where}{key} must be {what}, got {_short(self.table[key])}")
        return default

    def integer(self, key: str, default: Any = _MISSING, *, or_none: bool = False) -> Any:
        v = self._get(key, default, or_none)
        if v is default:
            return v
        return v if isinstance(v, int) and not isinstance(v, bool) else self._wrong(key, "an integer", default)

    def number(self, key: str, default: float, nested: str = "") -> float:
        """A finite number (a JSON integer or float), from the nested table `nested` if given."""
        table = self.table.get(nested) if nested else self.table
        v = table.get(key, default) if isinstance(table, dict) else default
        if isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) <= _FLOAT_MAX:  # NaN fails too
            return float(v)
        self.problems.append(
            f"{self.where}{nested + '.' if nested else ''}{key} must be a finite number, got {_short(v)}"
        )
        return default

    def flag(self, key: str, default: bool) -> bool:
        v = self._get(key, default, False)
        return v if isinstance(v, bool) else self._wrong(key, "true or false", default)

    def items(self, key: str, item: type, what: str) -> tuple | None:
        """A list of `item` (None when absent or null)."""
        v = self._get(key, None, True)
        if v is None:
            return None
        if isinstance(v, list) and all(isinstance(x, item) and not isinstance(x, bool) for x in v):
            return tuple(v)
        return self._wrong(key, f"a list of {what}", ())


def from_hf_dict(raw: Mapping[str, Any]) -> ModelConfig:
    """Translate an HF config.json dict (flat or multimodal wrapper) into a `ModelConfig`.

    Raises `ConfigError` for an unknown model type, a missing required field, a field of the
    wrong type (integers must be JSON integers, flags JSON booleans, numbers finite), then for
    any value `ModelConfig` refuses; each stage lists every problem it found, in one line.
    """
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config.json must hold a JSON object, got {type(raw).__name__}")
    mt = raw.get("model_type")
    outer = raw
    where = ""
    if mt in _WRAPPERS:
        if "text_config" not in raw:
            raise ConfigError(f"config of model_type {mt!r} has no text_config")
        if not isinstance(raw["text_config"], dict):
            raise ConfigError(f"text_config must be a JSON object, got {raw['text_config']!r}")
        d: dict[str, Any] = dict(raw["text_config"])
        d.setdefault("model_type", _WRAPPERS[mt])
        mt = d["model_type"]
        layout, prefix, where = "qwen3_5", "model.language_model", "text_config."
    else:
        d = dict(raw)
        layout = "qwen3_5" if mt in ("qwen3_5_text", "qwen3_5_moe_text") else "qwen3_next"
        prefix = "model"
    if mt not in _SUPPORTED:
        raise ConfigError(f"unsupported model_type {mt!r} (supported: {', '.join(_SUPPORTED + tuple(_WRAPPERS))})")
    f = _Fields(d, where)
    vocab, hidden = f.integer("vocab_size"), f.integer("hidden_size")
    n_layers, heads = f.integer("num_hidden_layers"), f.integer("num_attention_heads")
    if f.missing:
        raise ConfigError(f"config.json lacks required field(s): {', '.join(f.missing)}")
    if isinstance(n_layers, int) and n_layers > MAX_COUNT:
        raise ConfigError(f"{where}num_hidden_layers {n_layers} is over {MAX_COUNT}")

    rope_key = next((k for k in ("rope_parameters", "rope_scaling") if d.get(k) is not None), "")
    if rope_key and not isinstance(d[rope_key], dict):
        f.problems.append(f"{where}{rope_key} must be a JSON object, got {d[rope_key]!r}")
        rope_key = ""
    theta = f.number("rope_theta", f.number("rope_theta", 10000.0), rope_key)
    prf = f.number("partial_rotary_factor", f.number("partial_rotary_factor", 0.25), rope_key)

    layer_types = f.items("layer_types", str, "layer type names")
    if layer_types is None:
        interval = f.integer("full_attention_interval", 4)
        if isinstance(n_layers, int) and interval >= 1:
            layer_types = tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers))
        else:
            f.problems.append(f"{where}full_attention_interval must be a positive integer, got {interval!r}")

    is_moe_type = mt in ("qwen3_next", "qwen3_5_moe_text")
    experts_default = {"qwen3_next": 512, "qwen3_5_moe_text": 256}.get(mt, 0)
    num_experts = f.integer("num_experts", experts_default) if is_moe_type else 0
    defaults_heads = {"qwen3_next": 2, "qwen3_5_text": 4, "qwen3_5_moe_text": 2}
    num_mtp = f.integer("num_nextn_predict_layers", f.integer("mtp_num_hidden_layers", 0, or_none=True), or_none=True)
    # A wrapper's own flags are the fallback of its text_config's (HF's text classes read the inner ones).
    o = _Fields(outer, "") if outer is not d else None
    tie = f.flag("tie_word_embeddings", o.flag("tie_word_embeddings", False) if o else False)
    postnorm = f.flag("mtp_hidden_postnorm", o.flag("mtp_hidden_postnorm", True) if o else True)
    values = dict(
        model_type=mt,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=f.integer("intermediate_size", 5632),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=f.integer("num_key_value_heads", defaults_heads[mt]),
        head_dim=f.integer("head_dim", 256),
        layer_types=layer_types or (),
        rms_norm_eps=f.number("rms_norm_eps", 1e-6),
        rope_theta=theta,
        partial_rotary_factor=prf,
        attention_bias=f.flag("attention_bias", False),
        linear_conv_kernel_dim=f.integer("linear_conv_kernel_dim", 4),
        linear_key_head_dim=f.integer("linear_key_head_dim", 128),
        linear_value_head_dim=f.integer("linear_value_head_dim", 128),
        linear_num_key_heads=f.integer("linear_num_key_heads", 16),
        linear_num_value_heads=f.integer("linear_num_value_heads", 32),
        num_experts=num_experts,
        num_experts_per_tok=f.integer("num_experts_per_tok", 10 if mt == "qwen3_next" else 8) if num_experts else 0,
        moe_intermediate_size=f.integer("moe_intermediate_size", 512) if num_experts else 0,
        shared_expert_intermediate_size=f.integer("shared_expert_intermediate_size", 512) if num_experts else 0,
        # Qwen3.5-MoE always renormalises the top-k.
        norm_topk_prob=f.flag("norm_topk_prob", True) if mt == "qwen3_next" else True,
        decoder_sparse_step=f.integer("decoder_sparse_step", 1) if mt == "qwen3_next" else 1,
        mlp_only_layers=(f.items("mlp_only_layers", int, "layer indices") or ()) if mt == "qwen3_next" else (),
        tie_word_embeddings=tie,
        num_mtp_layers=num_mtp,
        mtp_hidden_postnorm=postnorm,
        weight_layout=layout,
        trunk_prefix=prefix,
    )
    problems = f.problems + (o.problems if o else [])
    if problems:
        raise ConfigError(f"config.json ({len(problems)} problem(s)): " + "; ".join(problems))
    return ModelConfig(**values)


def load_model_config(source: str | os.PathLike | Mapping[str, Any]) -> ModelConfig:
    """Read a config from a dict, a config.json path, or a checkpoint directory holding one.
    Raises ConfigError when the file is absent, not a regular file, not UTF-8 JSON, or not a
    config `from_hf_dict` accepts."""
    if isinstance(source, Mapping):
        return from_hf_dict(source)
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"no config.json at {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"{path} is a directory, not a config.json file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object, got a JSON {type(raw).__name__}")
    return from_hf_dict(raw)
