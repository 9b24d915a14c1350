"""Quantised checkpoints: the schemes a config declares and the bytes their tensors take.

Owns: reading `quantization_config` (config.json) and ModelOpt's `hf_quant_config.json` into a
`Quantization`; the FP8 block layout (`scale_name`, `scale_shape`); which checkpoint tensors a
scheme converts (`converts`); and `tensor_bytes`, the one count of a tensor's stored bytes (with
its scales) that the loader's validation and the memory planner share.

Invariants:
- Only `quant_method: fp8` with `fmt: e4m3`, `activation_scheme: dynamic` and a two-integer
  `weight_block_size` is loadable; NVFP4 (ModelOpt `hf_quant_config.json`) is known to the
  planner's byte counts only; any other method is refused in one line naming it.
- FP8 layout: a converted `X.weight [..., out, in]` is stored e4m3 with
  `X.weight_scale_inv [..., ceil(out / b0), ceil(in / b1)]` (`W ≈ W_fp8 · scale_inv` per block).
- NVFP4 layout (ModelOpt): e2m1 values packed two per byte, one e4m3 scale per 16 values along
  the input axis, one f32 global scale per tensor.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

from metrale_jax.errors import MetraleError


class QuantizationError(MetraleError, ValueError):
    """A quantisation scheme this engine does not serve, or a malformed one (one line)."""


FP8 = "fp8"
NVFP4 = "nvfp4"
#: ModelOpt's NVFP4 group size (values per e4m3 scale, along the input axis).
NVFP4_GROUP = 16
#: The bytes of one stored block scale where the checkpoint is not on disk: the FP8 releases
#: store `weight_scale_inv` as bf16 (released_checkpoints.md).
FP8_SCALE_BYTES = 2


@dataclasses.dataclass(frozen=True)
class Quantization:
    """A checkpoint's weight format: `method` (fp8 | nvfp4), the FP8 `block` (rows, cols), and the
    module names the scheme leaves at full precision (`keep`, substrings of tensor names)."""

    method: str
    block: tuple[int, int] = (128, 128)
    keep: tuple[str, ...] = ()

    @property
    def loadable(self) -> bool:
        """Whether the loader serves this format (the planner counts every one)."""
        return self.method == FP8


def scale_name(name: str) -> str:
    """The block-scale tensor of FP8 tensor `name` (`X.weight` -> `X.weight_scale_inv`)."""
    return f"{name}_scale_inv"


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The block-scale shape of a weight [..., out, in]: [..., ceil(out / b0), ceil(in / b1)]."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def converts(q: Quantization | None, name: str, kind: str) -> bool:
    """Whether scheme `q` stores checkpoint tensor `name` (a parameter of spec `kind`)
    quantised: only projections (`linear` leaves) whose module is not in `q.keep`. A kept entry
    matches whole dotted components of the module name (`mlp.gate` keeps `layers.0.mlp.gate`,
    not `layers.0.mlp.gate_proj`)."""
    module = f".{name.removesuffix('.weight')}."
    return q is not None and kind == "linear" and not any(f".{k.strip('.')}." in module for k in q.keep)


def tensor_bytes(shape: tuple[int, ...], itemsize: int, q: Quantization | None, converted: bool) -> int:
    """Stored bytes of one checkpoint tensor of `shape`: `itemsize` each when not `converted`;
    FP8: one byte a value plus its block scales; NVFP4: half a byte a value, one byte per 16
    values and a 4-byte global scale."""
    n = math.prod(shape)
    if not converted or q is None:
        return n * itemsize
    if q.method == FP8:
        return n + math.prod(scale_shape(shape, q.block)) * FP8_SCALE_BYTES
    return math.ceil(n / 2) + math.ceil(n / NVFP4_GROUP) + 4


def _fp8(raw: Mapping[str, Any]) -> Quantization:
    fmt, act, block = raw.get("fmt", "e4m3"), raw.get("activation_scheme", "dynamic"), raw.get("weight_block_size")
    if fmt != "e4m3":
        raise QuantizationError(f"quantization_config: fp8 format {fmt!r} is not supported (supported: e4m3)")
    if act != "dynamic":
        raise QuantizationError(f"quantization_config: activation_scheme {act!r} is not supported (supported: dynamic)")
    if not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise QuantizationError(f"quantization_config: weight_block_size must be two positive integers, got {block!r}")
    keep = raw.get("modules_to_not_convert") or []
    if not isinstance(keep, list) or not all(isinstance(k, str) for k in keep):
        raise QuantizationError("quantization_config: modules_to_not_convert must be a list of names")
    return Quantization(FP8, (block[0], block[1]), tuple(keep))


def read_quantization(directory: str | os.PathLike, raw: Mapping[str, Any]) -> Quantization | None:
    """The weight format of a checkpoint: config.json's `quantization_config` (`raw`, top level or
    text_config), or `hf_quant_config.json` (ModelOpt) in `directory`; None when neither.
    Raises QuantizationError, one line naming any method this engine does not know."""
    qc = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    modelopt = os.path.join(os.fspath(directory), "hf_quant_config.json")
    if qc is None and os.path.isfile(modelopt):
        try:
            with open(modelopt, encoding="utf-8") as f:
                qc = json.load(f).get("quantization", {})
        except (OSError, ValueError, AttributeError) as e:
            raise QuantizationError(f"{modelopt}: not a ModelOpt quantisation config ({e})") from None
        qc = {"quant_method": str(qc.get("quant_algo", "")).lower(), **qc}
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise QuantizationError(f"quantization_config must be a JSON object, got {qc!r}")
    method = qc.get("quant_method")
    if method == FP8:
        return _fp8(qc)
    if method in (NVFP4, "modelopt") and str(qc.get("quant_algo", NVFP4)).lower() == NVFP4:
        keep = qc.get("exclude_modules") or qc.get("modules_to_not_convert") or []
        return Quantization(NVFP4, (1, NVFP4_GROUP), tuple(k.strip("*") for k in keep if isinstance(k, str)))
    raise QuantizationError(f"quantization method {method!r} is not supported (supported: fp8; planner only: nvfp4)")
