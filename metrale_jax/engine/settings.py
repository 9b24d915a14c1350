"""Serve settings: the one Click option set, MODEL.toml `[behavior]`, and their resolution.

Owns: `serve_options` (every engine flag, reused by `serve`-like commands, recipes and the memory
planner), `Behavior` (a model's MODEL.toml `[behavior]` defaults), `resolve_settings` (flag →
MODEL.toml → engine default, with every violation collected) and `EngineSettings` (the frozen,
hashable result the engine is built from; static under `jax.jit`).

Invariants:
- Each flag's default is stated once, in `_FLAGS`; `resolve_settings` fills absent keys from it.
- Resolution precedence: an explicit flag wins (even when it equals the engine default), then
  a positive / non-empty MODEL.toml value, then the engine default; each effective value
  records the rule that set it (`EngineSettings.provenance`, excluded from equality and hash).
- Validation never stops at the first problem: `SettingsError.messages` holds one line each.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import click
import tomli

from metrale_jax.engine.capacity import (
    AUTO_MAX_SLOTS,
    DECODE_ROLLBACK_RING_SLOTS,
    DEFAULT_K_LADDER,
    MAX_MTP_MAX_SEQS,
    KLadder,
    format_k_ladder,
    parse_k_ladder,
)

KV_CACHE_DTYPES = ("bf16", "fp8", "f32")
SSM_H_DTYPES = ("f32", "f16-pool")
SSM_ROLLBACK_MODES = ("snapshot", "replay")
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


class SettingsError(ValueError):
    """Every violation found in one set of serve settings, one message each."""

    def __init__(self, messages: list[str] | tuple[str, ...]):
        self.messages = tuple(messages)
        super().__init__("\n".join(self.messages))


class BehaviorError(ValueError):
    """A MODEL.toml that cannot be read as `[behavior]` defaults (one clear line)."""


@dataclasses.dataclass(frozen=True)
class Behavior:
    """A model's MODEL.toml `[behavior]` defaults; 0 / "" mean absent (engine default applies).

    Only `default_num_drafts`, `mtp_max_seqs` and `default_kv_dtype` are read; other keys are
    ignored. `source` says where they came from, for reports.
    """

    default_num_drafts: int = 0
    mtp_max_seqs: int = 0
    default_kv_dtype: str = ""
    source: str = "absent: engine defaults"

    @classmethod
    def parse(cls, text: str, source: str) -> Behavior:
        """Parse MODEL.toml `text`. Raises BehaviorError on bad TOML or a key of the wrong type
        (integers must be non-negative integers, not booleans; the dtype a string)."""
        try:
            doc = tomli.loads(text)
        except tomli.TOMLDecodeError as e:
            raise BehaviorError(f"{source}: not valid TOML ({e})") from None
        table = doc.get("behavior", {})
        if not isinstance(table, dict):
            raise BehaviorError(f"{source}: [behavior] must be a table")
        values: dict[str, Any] = {}
        for key in ("default_num_drafts", "mtp_max_seqs"):
            v = table.get(key, 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise BehaviorError(
                    f"{source}: [behavior] {key} must be a non-negative integer, got {v!r}"
                )
            values[key] = v
        kv = table.get("default_kv_dtype", "")
        if not isinstance(kv, str):
            raise BehaviorError(f"{source}: [behavior] default_kv_dtype must be a string, got {kv!r}")
        return cls(**values, default_kv_dtype=kv, source=source)

    @classmethod
    def load(cls, path: Path) -> Behavior:
        """Read `path`; an absent file gives the engine defaults (and says so in `source`)."""
        if not path.is_file():
            return cls(source=f"{path} absent: engine defaults")
        return cls.parse(path.read_text(encoding="utf-8"), str(path))


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
    provenance: tuple[Provenance, ...] = dataclasses.field(
        default=(), compare=False, repr=False
    )


@dataclasses.dataclass(frozen=True)
class _Flag:
    """One serve flag: its Click parameter name, default, type and help."""

    name: str
    default: Any
    type: Any
    help: str
    off: str | None = None  # the negative spelling of a presence-only boolean

    @property
    def opt(self) -> str:
        return "--" + self.name.replace("_", "-")


_FLAGS: tuple[_Flag, ...] = (
    _Flag("max_batch_size", "8", str, "Sequence slots: N (1..=128) or auto (fit to memory)."),
    _Flag("max_seq_len", 32768, int, "Longest sequence, prompt + output tokens."),
    _Flag("block_size", 16, int, "Tokens per paged-KV block."),
    _Flag("speculative", False, bool, "MTP speculative decoding.", off="--no-speculative"),
    _Flag("num_drafts", None, int,
          "Drafts per verify [MODEL.toml default_num_drafts, else 1]; K = drafts + 1."),
    _Flag("mtp_max_seqs", None, int,
          "MTP dispatch cap, 1..=128 [MODEL.toml mtp_max_seqs, else 32]."),
    _Flag("mtp_k_ladder", None, str,
          "K ladder n_max:drafts,... [4:3,8:3,16:1,32:1]: drafts at n active sequences."),
    _Flag("kv_cache_dtype", None, str,
          "KV-cache dtype bf16|fp8|f32 [MODEL.toml default_kv_dtype, else fp8]."),
    _Flag("ssm_h_dtype", None, str, "Recurrent h-state pool dtype f32|f16-pool [f32]."),
    _Flag("ssm_rollback_mode", "snapshot", str,
          "Verify rollback: snapshot (per-draft states) or replay."),
    _Flag("max_prefill_tokens", 8192, int, "Prefill chunk in tokens (8192 = unset)."),
    _Flag("enable_prefix_caching", False, bool, "Prefix caching (with SSM snapshots).",
          off="--disable-prefix-caching"),
    _Flag("ssm_cache_slots", 16, int, "Prefix-cache SSM snapshot (Marconi) slots."),
    _Flag("ssm_decode_ring_slots", "auto", str,
          "Decode-rollback ring depth: auto or 0..=8."),
    _Flag("gpu_memory_utilization", 0.90, float, "Fraction of device memory to use, in (0, 1]."),
)
SERVE_SETTINGS: frozenset[str] = frozenset(f.name for f in _FLAGS)


def serve_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a Click command with every serve flag (parameters named as `EngineSettings`
    fields, plus `mtp_k_ladder`). Values stay raw: pass them to `resolve_settings`."""
    for flag in reversed(_FLAGS):
        if flag.type is bool:
            f = click.option(f"{flag.opt}/{flag.off}", flag.name, default=flag.default,
                             help=flag.help)(f)
        else:
            f = click.option(flag.opt, flag.name, type=flag.type, default=flag.default,
                             show_default=flag.default is not None, help=flag.help)(f)
    return f


def pop_serve_raw(ctx: click.Context, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Remove the serve flags from a command's `kwargs`; return those given on the command line
    (not defaulted), ready for `resolve_settings`, which then knows what was asked for."""
    raw = {name: kwargs.pop(name) for name in list(kwargs) if name in SERVE_SETTINGS}
    return {name: value for name, value in raw.items()
            if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT}


def _shown(value: Any) -> str:
    """A flag value as the requested → effective table shows it ("" when unset)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return "" if value is None else str(value)


def resolve_settings(
    raw: Mapping[str, Any], behavior: Behavior | None, *, auto_slots: int
) -> EngineSettings:
    """Resolve raw serve flags into `EngineSettings`.

    `raw` maps the flags that were given (parameter names, values as `serve_options` parses
    them; see `pop_serve_raw`) to values; absent names take the flag's default (rule "engine
    default"), unknown names are refused. `behavior` is the model's MODEL.toml
    `[behavior]` (None: absent). `auto_slots` is what `--max-batch-size auto` resolves to (the
    caller's fit; 1..=128). Raises `SettingsError` listing every violation.
    """
    if not 1 <= auto_slots <= AUTO_MAX_SLOTS:
        raise ValueError(f"auto_slots {auto_slots} is outside 1..={AUTO_MAX_SLOTS}")
    unknown = sorted(set(raw) - SERVE_SETTINGS)
    if unknown:
        raise SettingsError([f"unknown serve setting {name!r}" for name in unknown])
    v = {f.name: raw.get(f.name, f.default) for f in _FLAGS}
    b = behavior or Behavior()
    errors: list[str] = []
    rows: dict[str, Provenance] = {}

    def row(name: str, effective: Any, rule: str) -> None:
        rows[name] = Provenance("--" + name.replace("_", "-"), _shown(raw.get(name)),
                                _shown(effective), rule)

    def plain(name: str) -> str:
        return RULE_FLAG if name in raw else RULE_DEFAULT

    # --max-batch-size N|auto
    mbs_text = str(v["max_batch_size"]).strip()
    if mbs_text == "auto":
        max_batch_size = auto_slots
        row("max_batch_size", max_batch_size, f"{RULE_AUTO} ({auto_slots} slots)")
    elif mbs_text.isdigit() and 1 <= int(mbs_text) <= AUTO_MAX_SLOTS:
        max_batch_size = int(mbs_text)
        row("max_batch_size", max_batch_size, plain("max_batch_size"))
    else:
        max_batch_size = 0
        errors.append(f"--max-batch-size must be an integer in 1..={AUTO_MAX_SLOTS} or auto, "
                      f"got {mbs_text!r}")

    for name, low in (("max_seq_len", 1), ("block_size", 1), ("max_prefill_tokens", 1),
                      ("ssm_cache_slots", 0)):
        if v[name] < low:
            errors.append(f"--{name.replace('_', '-')} must be >= {low}, got {v[name]}")
        row(name, v[name], plain(name))
    for name in ("speculative", "enable_prefix_caching"):
        row(name, bool(v[name]), plain(name))

    # --num-drafts: flag → MODEL.toml default_num_drafts → 1
    if v["num_drafts"] is not None:
        num_drafts = v["num_drafts"]
        rule = RULE_FLAG
        if num_drafts < 1:
            errors.append(f"--num-drafts must be >= 1, got {num_drafts}")
        elif num_drafts > 1 and not v["speculative"]:
            errors.append(f"--num-drafts {num_drafts} needs --speculative "
                          "(no draft proposer is on)")
    elif b.default_num_drafts > 0:
        num_drafts, rule = b.default_num_drafts, f"{RULE_MODEL_TOML} default_num_drafts"
    else:
        num_drafts, rule = DEFAULT_NUM_DRAFTS, RULE_DEFAULT
    row("num_drafts", num_drafts, rule)

    # --mtp-max-seqs: flag → MODEL.toml mtp_max_seqs → 32, then 1..=128
    if v["mtp_max_seqs"] is not None:
        mtp_max_seqs, rule = v["mtp_max_seqs"], RULE_FLAG
    elif b.mtp_max_seqs > 0:
        mtp_max_seqs, rule = b.mtp_max_seqs, f"{RULE_MODEL_TOML} mtp_max_seqs"
    else:
        mtp_max_seqs, rule = DEFAULT_MTP_MAX_SEQS, RULE_DEFAULT
    if not 1 <= mtp_max_seqs <= MAX_MTP_MAX_SEQS:
        errors.append(f"--mtp-max-seqs {mtp_max_seqs} ({rule}) must be in "
                      f"1..={MAX_MTP_MAX_SEQS}")
    row("mtp_max_seqs", mtp_max_seqs, rule)

    # --mtp-k-ladder
    if v["mtp_k_ladder"] is not None:
        try:
            k_ladder = parse_k_ladder(v["mtp_k_ladder"])
        except ValueError as e:
            k_ladder = DEFAULT_K_LADDER
            errors.append(f"--mtp-k-ladder: {e}")
        rule = RULE_FLAG
    else:
        k_ladder, rule = DEFAULT_K_LADDER, RULE_DEFAULT
    row("mtp_k_ladder", format_k_ladder(k_ladder), rule)

    # --kv-cache-dtype: flag → MODEL.toml default_kv_dtype → fp8
    if v["kv_cache_dtype"] is not None:
        kv_dtype, rule = v["kv_cache_dtype"], RULE_FLAG
        if b.default_kv_dtype and b.default_kv_dtype != kv_dtype:
            rule = f"{RULE_FLAG} (MODEL.toml says {b.default_kv_dtype})"
    elif b.default_kv_dtype:
        kv_dtype, rule = b.default_kv_dtype, f"{RULE_MODEL_TOML} default_kv_dtype"
    else:
        kv_dtype, rule = DEFAULT_KV_CACHE_DTYPE, RULE_DEFAULT
    if kv_dtype not in KV_CACHE_DTYPES:
        errors.append(f"--kv-cache-dtype {kv_dtype!r} ({rule}) must be one of "
                      f"{', '.join(KV_CACHE_DTYPES)}")
    row("kv_cache_dtype", kv_dtype, rule)

    ssm_h_dtype = v["ssm_h_dtype"] if v["ssm_h_dtype"] is not None else DEFAULT_SSM_H_DTYPE
    if ssm_h_dtype not in SSM_H_DTYPES:
        errors.append(f"--ssm-h-dtype must be one of {', '.join(SSM_H_DTYPES)}, "
                      f"got {ssm_h_dtype!r}")
    row("ssm_h_dtype", ssm_h_dtype, plain("ssm_h_dtype"))

    if v["ssm_rollback_mode"] not in SSM_ROLLBACK_MODES:
        errors.append(f"--ssm-rollback-mode must be one of {', '.join(SSM_ROLLBACK_MODES)}, "
                      f"got {v['ssm_rollback_mode']!r}")
    row("ssm_rollback_mode", v["ssm_rollback_mode"], plain("ssm_rollback_mode"))

    # --ssm-decode-ring-slots auto|0..=8: auto is off under speculation (verify checkpoints
    # already roll back a step), else the full depth.
    ring_text = str(v["ssm_decode_ring_slots"]).strip()
    if ring_text == "auto":
        ring = 0 if v["speculative"] else DECODE_ROLLBACK_RING_SLOTS
        rule = f"{RULE_AUTO} ({'off under --speculative' if v['speculative'] else 'full depth'})"
    elif ring_text.isdigit() and int(ring_text) <= DECODE_ROLLBACK_RING_SLOTS:
        ring, rule = int(ring_text), plain("ssm_decode_ring_slots")
    else:
        ring, rule = 0, plain("ssm_decode_ring_slots")
        errors.append(f"--ssm-decode-ring-slots must be auto or an integer in "
                      f"0..={DECODE_ROLLBACK_RING_SLOTS}, got {ring_text!r}")
    row("ssm_decode_ring_slots", ring, rule)

    util = v["gpu_memory_utilization"]
    if not (isinstance(util, (int, float)) and math.isfinite(util) and 0 < util <= 1):
        errors.append(f"--gpu-memory-utilization must be in (0, 1], got {util}")
    row("gpu_memory_utilization", util, plain("gpu_memory_utilization"))

    if errors:
        raise SettingsError(errors)
    return EngineSettings(
        max_batch_size=max_batch_size,
        max_seq_len=v["max_seq_len"],
        block_size=v["block_size"],
        speculative=bool(v["speculative"]),
        num_drafts=num_drafts,
        mtp_max_seqs=mtp_max_seqs,
        k_ladder=k_ladder,
        kv_cache_dtype=kv_dtype,
        ssm_h_dtype=ssm_h_dtype,
        ssm_rollback_mode=v["ssm_rollback_mode"],
        max_prefill_tokens=v["max_prefill_tokens"],
        enable_prefix_caching=bool(v["enable_prefix_caching"]),
        ssm_cache_slots=v["ssm_cache_slots"],
        ssm_decode_ring_slots=ring,
        gpu_memory_utilization=float(util),
        provenance=tuple(rows[f.name] for f in _FLAGS),
    )
