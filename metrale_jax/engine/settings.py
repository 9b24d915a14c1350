"""Serve settings: their names and defaults, their resolution, and the frozen result the engine runs on.

Owns: `SERVE_DEFAULTS` (every serve setting by name, with its default; the CLI's flag table,
`metrale_jax_cli.serve_flags`, gives each its option, value type and help), `option_of` (how a
message names a setting), `Behavior` (a model's MODEL.toml `[behavior]` defaults, as values;
`metrale_jax_cli.model_toml` reads the file), K-ladder text (`parse_k_ladder`,
`format_k_ladder`), `resolve_settings` (flag -> MODEL.toml -> engine default, with every
violation collected), `EngineSettings` (the frozen, hashable result the engine is built from;
static under `jax.jit`) and `unsupported` (the valid settings this engine does not implement for
a model: the one list both the `Engine` and the memory planner refuse by).

Invariants:
- Pure: no Click, no TOML, no I/O; importing this module loads nothing above the engine. Names
  and values only: the flag table (value types, a boolean's negative spelling, help text) is the
  CLI's; a message names a setting by the one rule `option_of`.
- Each setting's default is stated once, in `SERVE_DEFAULTS`; `resolve_settings` fills absent
  keys from it.
- Resolution precedence: an explicit flag wins (even when it equals the engine default), then
  a positive / non-empty MODEL.toml value, then the engine default; each effective value
  records the rule that set it (`EngineSettings.provenance`, excluded from equality and hash).
- Validation never stops at the first problem: `SettingsError.messages` holds one line each.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from metrale_jax.config import ModelConfig
from metrale_jax.engine.capacity import (
    AUTO_MAX_SLOTS,
    DECODE_ROLLBACK_RING_SLOTS,
    DEFAULT_K_LADDER,
    MAX_MTP_MAX_SEQS,
    KLadder,
)
from metrale_jax.errors import MetraleError

KV_CACHE_DTYPES = ("bf16", "fp8", "f32")
SSM_H_DTYPES = ("f32", "f16-pool")
SSM_ROLLBACK_MODES = ("snapshot", "replay")
#: How a sampled speculative verify accepts drafts (`engine.sampling`): gumbel (the drafter coupled to
#: the target's noise; plain sampling's tokens) or rejection (min(1, p/q), the residual, the bonus).
SPECULATIVE_SAMPLING_MODES = ("gumbel", "rejection")
#: Drafts per verify when neither the flag nor MODEL.toml says.
DEFAULT_NUM_DRAFTS = 1
#: The MTP dispatch cap when neither the flag nor MODEL.toml says.
DEFAULT_MTP_MAX_SEQS = 32
#: The KV-cache dtype when neither the flag nor MODEL.toml says.
DEFAULT_KV_CACHE_DTYPE = "fp8"
#: The recurrent h-state dtype when the flag is unset.
DEFAULT_SSM_H_DTYPE = "f32"

RULE_FLAG = "flag"
RULE_MODEL_TOML = "MODEL.toml [behavior]"
RULE_DEFAULT = "engine default"
RULE_AUTO = "auto"


class SettingsError(MetraleError, ValueError):
    """Every violation found in one set of serve settings, one message each."""

    def __init__(self, messages: list[str] | tuple[str, ...]):
        super().__init__("\n".join(messages))
        self.messages = tuple(messages)


@dataclasses.dataclass(frozen=True)
class Behavior:
    """A model's MODEL.toml `[behavior]` defaults; 0 / "" mean absent (engine default applies).

    Only `default_num_drafts`, `mtp_max_seqs` and `default_kv_dtype` are read from the file;
    `source` says where they came from, for reports.
    """

    default_num_drafts: int = 0
    mtp_max_seqs: int = 0
    default_kv_dtype: str = ""
    source: str = "absent: engine defaults"


@dataclasses.dataclass(frozen=True)
class Provenance:
    """One row of the requested → effective table: `requested` is the flag's text ("" unset)."""

    setting: str
    requested: str
    effective: str
    rule: str


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """Resolved serve settings (hashable; pass as a static argument under `jax.jit`).

    `max_batch_size` is the real sequence-slot count; `num_drafts` is drafts per verify
    (K = num_drafts + 1, defined even without speculation); `ssm_decode_ring_slots` is the
    resolved ring depth. `provenance` explains each value and takes no part in equality.
    """

    max_batch_size: int
    max_seq_len: int
    block_size: int
    speculative: bool
    num_drafts: int
    mtp_max_seqs: int
    k_ladder: KLadder
    kv_cache_dtype: str
    ssm_h_dtype: str
    ssm_rollback_mode: str
    max_prefill_tokens: int
    enable_prefix_caching: bool
    ssm_cache_slots: int
    ssm_decode_ring_slots: int
    gpu_memory_utilization: float
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    batch_invariant: bool = False
    speculative_sampling: str = "gumbel"
    provenance: tuple[Provenance, ...] = dataclasses.field(default=(), compare=False, repr=False)


#: Every serve setting (an `EngineSettings` field, or `mtp_k_ladder`: the K ladder as text) and its
#: default when not given, in the order the provenance table lists them.
SERVE_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "max_batch_size": "8",
        "max_seq_len": 32768,
        "block_size": 16,
        "speculative": False,
        "num_drafts": None,
        "mtp_max_seqs": None,
        "mtp_k_ladder": None,
        "kv_cache_dtype": None,
        "ssm_h_dtype": None,
        "ssm_rollback_mode": "snapshot",
        "max_prefill_tokens": 8192,
        "enable_prefix_caching": False,
        "ssm_cache_slots": 16,
        "ssm_decode_ring_slots": "auto",
        "gpu_memory_utilization": 0.90,
        "tensor_parallel_size": 1,
        "expert_parallel_size": 1,
        "batch_invariant": False,
        "speculative_sampling": "gumbel",
    }
)


def option_of(setting: str) -> str:
    """How messages and the provenance table name a serve setting: as its command-line option
    (`max_seq_len` -> `--max-seq-len`)."""
    return "--" + setting.replace("_", "-")


def parse_k_ladder(spec: str) -> KLadder:
    """Parse a K ladder `"n_max:drafts,n_max:drafts,..."` (e.g. `"4:3,8:3,16:1,32:1"`).

    Contract: whole-or-nothing. Every step is two positive integers joined by `:`, steps are
    comma-separated, and `n_max` strictly increases (a step that could never be chosen is
    refused). Whitespace around numbers is ignored. Anything else raises `ValueError` naming
    the offending part.
    """
    text = spec.strip()
    if not text:
        raise ValueError("K ladder is empty; expected n_max:drafts steps like 4:3,8:3,16:1,32:1")
    steps: list[tuple[int, int]] = []
    for part in text.split(","):
        fields = part.split(":")
        if len(fields) != 2 or not all(f.strip().isdigit() for f in fields):
            raise ValueError(f"K ladder step {part.strip()!r} is not n_max:drafts with two positive integers")
        n_max, drafts = (int(f) for f in fields)
        if n_max < 1 or drafts < 1:
            raise ValueError(f"K ladder step {part.strip()!r}: n_max and drafts must be >= 1")
        if steps and n_max <= steps[-1][0]:
            raise ValueError(f"K ladder step {part.strip()!r}: n_max must increase (previous {steps[-1][0]})")
        steps.append((n_max, drafts))
    return tuple(steps)


def format_k_ladder(ladder: KLadder) -> str:
    """The `n_max:drafts,...` text of `ladder`; `parse_k_ladder` inverts it."""
    return ",".join(f"{n}:{k}" for n, k in ladder)


def _shown(value: Any) -> str:
    """A flag value as the requested → effective table shows it ("" when unset)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return "" if value is None else str(value)


def _tiered(flag: Any, toml: Any, toml_key: str, default: Any) -> tuple[Any, str]:
    """flag → MODEL.toml → engine default: the flag when given (even if it equals the default),
    else the MODEL.toml value when positive / non-empty, else `default`; with the rule."""
    if flag is not None:
        return flag, RULE_FLAG
    if toml:
        return toml, f"{RULE_MODEL_TOML} {toml_key}"
    return default, RULE_DEFAULT


def _choice(flag: str, value: Any, rule: str, allowed: tuple[str, ...]) -> list[str]:
    """The violation (if any) of `value` not being one of `allowed`."""
    if value in allowed:
        return []
    return [f"{flag} {value!r} ({rule}) must be one of {', '.join(allowed)}"]


def _count_or_keyword(flag: str, text: str, keyword: str, low: int, high: int) -> int | None:
    """`text` as an integer in `low..=high`; None for `keyword`; ValueError otherwise."""
    text = text.strip()
    if text == keyword:
        return None
    if text.isdigit() and low <= int(text) <= high:
        return int(text)
    raise ValueError(f"{flag} must be an integer in {low}..={high} or {keyword}, got {text!r}")


def resolve_settings(raw: Mapping[str, Any], behavior: Behavior | None, *, auto_slots: int) -> EngineSettings:
    """Resolve raw serve flags into `EngineSettings`.

    `raw` maps the settings that were given (names of `SERVE_DEFAULTS`, values typed as the CLI
    parses them: `metrale_jax_cli.serve_flags`) to values; absent names take their default (rule
    "engine default"), unknown names are refused. `behavior` is the model's MODEL.toml
    `[behavior]` (None: absent). `auto_slots` is what `--max-batch-size auto` resolves to (the
    caller's fit; 1..=128). Raises `SettingsError` listing every violation.
    """
    if not 1 <= auto_slots <= AUTO_MAX_SLOTS:
        raise ValueError(f"auto_slots {auto_slots} is outside 1..={AUTO_MAX_SLOTS}")
    unknown = sorted(set(raw) - SERVE_DEFAULTS.keys())
    if unknown:
        raise SettingsError([f"unknown serve setting {name!r}" for name in unknown])
    v = {name: raw.get(name, default) for name, default in SERVE_DEFAULTS.items()}
    b = behavior or Behavior()
    errors: list[str] = []
    eff: dict[str, Any] = {}
    rule: dict[str, str] = {name: RULE_FLAG if name in raw else RULE_DEFAULT for name in v}

    try:
        slots = _count_or_keyword("--max-batch-size", str(v["max_batch_size"]), "auto", 1, AUTO_MAX_SLOTS)
    except ValueError as e:
        slots = 0
        errors.append(str(e))
    if slots is None:
        slots, rule["max_batch_size"] = auto_slots, f"{RULE_AUTO} ({auto_slots} slots)"
    eff["max_batch_size"] = slots

    for name, low in (
        ("max_seq_len", 1),
        ("block_size", 1),
        ("max_prefill_tokens", 1),
        ("ssm_cache_slots", 0),
        ("tensor_parallel_size", 1),
        ("expert_parallel_size", 1),
    ):
        if v[name] < low:
            errors.append(f"{option_of(name)} must be >= {low}, got {v[name]}")
        eff[name] = v[name]
    spec = eff["speculative"] = bool(v["speculative"])
    eff["enable_prefix_caching"] = bool(v["enable_prefix_caching"])
    eff["batch_invariant"] = bool(v["batch_invariant"])

    nd, rule["num_drafts"] = _tiered(v["num_drafts"], b.default_num_drafts, "default_num_drafts", DEFAULT_NUM_DRAFTS)
    if nd < 1:
        errors.append(f"--num-drafts must be >= 1, got {nd}")
    elif nd > 1 and v["num_drafts"] is not None and not spec:
        errors.append(f"--num-drafts {nd} needs --speculative (no draft proposer is on)")
    eff["num_drafts"] = nd

    m, rule["mtp_max_seqs"] = _tiered(v["mtp_max_seqs"], b.mtp_max_seqs, "mtp_max_seqs", DEFAULT_MTP_MAX_SEQS)
    if not 1 <= m <= MAX_MTP_MAX_SEQS:
        errors.append(f"--mtp-max-seqs {m} ({rule['mtp_max_seqs']}) must be in 1..={MAX_MTP_MAX_SEQS}")
    eff["mtp_max_seqs"] = m

    eff["mtp_k_ladder"] = DEFAULT_K_LADDER
    if v["mtp_k_ladder"] is not None:
        try:
            eff["mtp_k_ladder"] = parse_k_ladder(v["mtp_k_ladder"])
        except ValueError as e:
            errors.append(f"--mtp-k-ladder: {e}")

    kv, rule["kv_cache_dtype"] = _tiered(
        v["kv_cache_dtype"], b.default_kv_dtype, "default_kv_dtype", DEFAULT_KV_CACHE_DTYPE
    )
    if v["kv_cache_dtype"] is not None and b.default_kv_dtype not in ("", kv):
        rule["kv_cache_dtype"] = f"{RULE_FLAG} (MODEL.toml says {b.default_kv_dtype})"
    errors += _choice("--kv-cache-dtype", kv, rule["kv_cache_dtype"], KV_CACHE_DTYPES)
    eff["kv_cache_dtype"] = kv

    eff["ssm_h_dtype"] = DEFAULT_SSM_H_DTYPE if v["ssm_h_dtype"] is None else v["ssm_h_dtype"]
    errors += _choice("--ssm-h-dtype", eff["ssm_h_dtype"], rule["ssm_h_dtype"], SSM_H_DTYPES)
    eff["ssm_rollback_mode"] = v["ssm_rollback_mode"]
    errors += _choice("--ssm-rollback-mode", v["ssm_rollback_mode"], rule["ssm_rollback_mode"], SSM_ROLLBACK_MODES)
    eff["speculative_sampling"] = v["speculative_sampling"]
    errors += _choice(
        "--speculative-sampling", v["speculative_sampling"], rule["speculative_sampling"], SPECULATIVE_SAMPLING_MODES
    )

    # auto: off. A decode-rollback ring backs a decode watchdog's rollback, which this engine does not
    # have (every transition is a pure function; a failed step is simply not committed).
    try:
        ring = _count_or_keyword(
            "--ssm-decode-ring-slots", str(v["ssm_decode_ring_slots"]), "auto", 0, DECODE_ROLLBACK_RING_SLOTS
        )
    except ValueError as e:
        ring = 0
        errors.append(str(e))
    if ring is None:
        ring = 0
        rule["ssm_decode_ring_slots"] = f"{RULE_AUTO} (off: no decode watchdog to roll back for)"
    eff["ssm_decode_ring_slots"] = ring

    util = v["gpu_memory_utilization"]
    valid = isinstance(util, (int, float)) and math.isfinite(util) and 0 < util <= 1
    if not valid:
        errors.append(f"--gpu-memory-utilization must be in (0, 1], got {util}")
    eff["gpu_memory_utilization"] = float(util) if valid else 0.0

    if errors:
        raise SettingsError(errors)
    shown = {**eff, "mtp_k_ladder": format_k_ladder(eff["mtp_k_ladder"])}
    provenance = tuple(
        Provenance(option_of(name), _shown(raw.get(name)), _shown(shown[name]), rule[name]) for name in SERVE_DEFAULTS
    )
    fields = {("k_ladder" if k == "mtp_k_ladder" else k): val for k, val in eff.items()}
    return EngineSettings(**fields, provenance=provenance)


def unsupported(settings: EngineSettings, cfg: ModelConfig) -> list[str]:
    """The settings this engine cannot serve `cfg` with, one line each (empty: it can). The
    `Engine` refuses to start on any of them and the planner refuses to plan them."""
    out = []
    if settings.ssm_decode_ring_slots:
        out.append("--ssm-decode-ring-slots > 0 (this engine has no decode-rollback ring)")
    if settings.speculative and cfg.num_mtp_layers == 0:
        out.append("--speculative with a checkpoint that has no MTP layer")
    if settings.batch_invariant and settings.tensor_parallel_size * settings.expert_parallel_size > 1:
        out.append("--batch-invariant on several devices (the mode's products run on one CPU device)")
    return out
