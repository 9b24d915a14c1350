"""Hugging Face safetensors checkpoints: lazy, validated loading and writing.

Owns: the binding between HF tensor names (Qwen3-Next and Qwen3.5 layouts, plus the `mtp.*`
head) and the parameter tree of `metrale_jax.params`, and the safetensors file format itself
(a small reader that memory-maps the file, so bfloat16 and an 80B checkpoint load tensor by
tensor without a second host copy).

Invariants:
- Every problem with a checkpoint (missing, unexpected, mis-shaped or non-float tensors, a
  corrupt header, an index naming a missing shard) is found from the headers before any tensor
  is read, and reported together in one `CheckpointError`.
- A header is untrusted input: a tensor is read only after its dtype, shape and data_offsets
  were checked against the file (known dtype, non-negative integers, `begin <= end <=` the data
  section, `end - begin` = the shape's bytes) and against every other tensor (no shared byte),
  and an index only names shard files inside the checkpoint directory.
- `save_checkpoint(dir, cfg, params)` followed by `load_checkpoint(dir)` returns equal params.
- A leaf may be several tensors: the projections that read the same input are stacked by rows
  into one leaf (`metrale_jax.params`); Qwen3-Next's interleaved `in_proj_qkvz` / `in_proj_ba`
  are de-interleaved into the split Qwen3.5 order on load and re-interleaved on save; experts
  stored per expert or fused both load.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct as _struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from metrale_jax.config import FULL, ConfigError, ModelConfig, load_model_config
from metrale_jax.errors import MetraleError
from metrale_jax.model.fp8_linear import FP8_DTYPE, Fp8BlockWeight, e4m3_bits
from metrale_jax.params import attn_in_rows, dense_in_rows, gdn_in_rows, moe_router_rows, param_specs, shared_in_rows
from metrale_jax.quantization import Quantization, QuantizationError, read_quantization, scale_name, scale_shape


class CheckpointError(MetraleError, ValueError):
    """A checkpoint that cannot be loaded; the message lists every problem found."""


_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
}
_FLOAT = {"F64", "F32", "F16", "BF16"}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


# ---------------------------------------------------------------- the file format


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """Where one tensor lives: file, dtype tag, shape, byte range within the data section."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int
    data_offset: int

    def read(self) -> np.ndarray:
        """Memory-map the tensor's bytes (no copy until the caller converts it)."""
        count = math.prod(self.shape)
        arr = np.memmap(
            self.path, dtype=_DTYPES[self.dtype], mode="r", offset=self.data_offset + self.start, shape=(count,)
        )
        return arr.reshape(self.shape)


def _counts(x: object, n: int | None = None) -> bool:
    """`x` is a JSON list of non-negative integers (of length `n` when given)."""
    return (
        isinstance(x, list)
        and (n is None or len(x) == n)
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in x)
    )


def _entry(path: str, name: str, info: object, data_size: int, data_offset: int) -> TensorRef | list[str]:
    """One header entry as a `TensorRef`, or the problems that make it unusable."""
    if not isinstance(info, dict):
        return [f"entry {name!r} is not a JSON object"]
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
    if missing:
        return [f"tensor {name!r} lacks {', '.join(missing)}"]
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    problems = []
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        problems.append(f"tensor {name!r} has unsupported dtype {dtype!r}")
    if not _counts(shape):
        problems.append(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
    if not _counts(offsets, 2):
        problems.append(f"tensor {name!r}: data_offsets {offsets!r} are not two non-negative integers")
    if problems:
        return problems
    begin, end = offsets
    want = math.prod(shape) * np.dtype(_DTYPES[dtype]).itemsize
    if not begin <= end <= data_size:
        return [f"tensor {name!r}: data_offsets [{begin}, {end}] are not within the {data_size}-byte data section"]
    if end - begin != want:
        return [
            f"tensor {name!r}: data_offsets [{begin}, {end}] hold {end - begin} bytes; "
            f"shape {shape} of {dtype} needs {want}"
        ]
    return TensorRef(path, dtype, tuple(shape), begin, end, data_offset)


def _overlaps(refs: dict[str, TensorRef]) -> list[str]:
    """Pairs of tensors whose byte ranges share a byte (each range is compared with the one
    reaching furthest among those starting before it)."""
    problems, reach = [], None
    for name, r in sorted(((n, r) for n, r in refs.items() if r.end > r.start), key=lambda x: (x[1].start, x[0])):
        if reach is not None and r.start < reach[1].end:
            problems.append(
                f"tensors {reach[0]!r} and {name!r} overlap (data_offsets "
                f"[{reach[1].start}, {reach[1].end}] and [{r.start}, {r.end}])"
            )
        if reach is None or r.end > reach[1].end:
            reach = (name, r)
    return problems


def _parse_header(path: str) -> tuple[dict[str, TensorRef], list[str]]:
    """The tensors of one safetensors file and the problems of its header (its entries are not
    read at all when the header itself cannot be parsed)."""
    try:
        if os.path.isdir(path):
            return {}, [f"{path} is a directory, not a safetensors file"]
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                return {}, [f"{path}: not a safetensors file (shorter than 8 bytes)"]
            (n,) = _struct.unpack("<Q", raw)
            if n > size - 8 or n > 100 * 2**20:
                return {}, [f"{path}: corrupt safetensors header (length {n} in a {size}-byte file)"]
            header = json.loads(f.read(n).decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return {}, [f"{path}: corrupt safetensors header ({e})"]
    except FileNotFoundError:
        return {}, [f"{path}: file not found"]
    except OSError as e:
        return {}, [f"{path}: cannot read ({e.strerror})"]
    if not isinstance(header, dict):
        return {}, [f"{path}: corrupt safetensors header (not a JSON object)"]
    refs: dict[str, TensorRef] = {}
    problems: list[str] = []
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        problems.append("__metadata__ must map names to strings")
    for name, info in header.items():
        if name != "__metadata__":
            entry = _entry(path, name, info, size - 8 - n, 8 + n)
            if isinstance(entry, TensorRef):
                refs[name] = entry
            else:
                problems += entry
    problems += _overlaps(refs)
    return refs, [f"{path}: {p}" for p in problems]


def _raise_problems(what: str, problems: list[str]) -> None:
    """One CheckpointError listing `problems` (the first 20, then a count), if there are any."""
    if not problems:
        return
    if len(problems) == 1:
        raise CheckpointError(problems[0])
    shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
    raise CheckpointError(f"{what} ({len(problems)} problem(s)): " + "; ".join(shown))


def read_header(path: str) -> dict[str, TensorRef]:
    """Parse and validate a safetensors header: every entry's dtype known, shape a list of
    non-negative integers, data_offsets two non-negative integers with `begin <= end <=` the
    data section and `end - begin` the shape's bytes, and no two tensors sharing a byte.
    Raises CheckpointError listing every problem."""
    refs, problems = _parse_header(path)
    _raise_problems("corrupt safetensors header", problems)
    return refs


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    """Write tensors (any of the supported numpy dtypes, bfloat16 included) as safetensors."""
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        b = a.tobytes()
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((-len(h)) % 8)
    with open(path, "wb") as f:
        f.write(_struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def _weight_map(index: str, directory: str) -> dict[str, str]:
    """The index's `weight_map` (tensor name -> shard file name in `directory`)."""
    try:
        with open(index, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
    outside = sorted({s for s in weight_map.values() if os.path.basename(s) != s or s in ("", ".", "..")})
    if outside:
        raise CheckpointError(f"{index}: weight_map names shard(s) outside {directory}: {', '.join(outside)}")
    return weight_map


def _merge(files: Sequence[str], directory: str) -> tuple[dict[str, TensorRef], list[str]]:
    """The tensors of several safetensors files in `directory`, and every problem: each file's
    header problems and any tensor held by two files."""
    refs: dict[str, TensorRef] = {}
    problems: list[str] = []
    for name in files:
        part, bad = _parse_header(os.path.join(directory, name))
        problems += bad
        for t in sorted(set(part) & set(refs)):
            problems.append(f"tensor {t!r} is in both {refs[t].path} and {part[t].path}")
        refs.update(part)
    return refs, problems


def index_checkpoint(directory: str) -> dict[str, TensorRef]:
    """All tensors of a checkpoint directory: single file or sharded via the index JSON. Raises
    CheckpointError listing every problem of every header (and of the index)."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = _weight_map(index, directory)
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not os.path.exists(os.path.join(directory, s))]
        if missing:
            raise CheckpointError(f"{index} names missing shard(s): {', '.join(missing)}")
        refs, problems = _merge(shards, directory)
        if not problems:
            problems = [
                f"{index} puts tensor {t!r} in {s}, which does not hold it"
                for t, s in sorted(weight_map.items())
                if t not in refs or os.path.basename(refs[t].path) != s
            ]
    else:
        single = os.path.join(directory, "model.safetensors")
        files = (
            ["model.safetensors"]
            if os.path.lexists(single)
            else sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        )
        if not files:
            raise CheckpointError(f"{directory}: no model.safetensors, index or *.safetensors file")
        refs, problems = _merge(files, directory)
    _raise_problems("corrupt checkpoint", problems)
    return refs


# ---------------------------------------------------------------- name bindings


@dataclasses.dataclass(frozen=True)
class Binding:
    """One parameter leaf and the HF tensors it is made of.

    assemble(list of arrays in `names` order) -> leaf; split(leaf) -> list of arrays.
    """

    path: tuple
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    assemble: Callable[[Sequence[np.ndarray]], np.ndarray]
    split: Callable[[np.ndarray], list[np.ndarray]]


def _one(path, name, shape, fwd=lambda x: x, back=lambda x: x):
    return Binding(path, (name,), (shape,), lambda a: fwd(a[0]), lambda w: [back(w)])


def _qkvz_layout(cfg: ModelConfig) -> tuple[int, int, int, int]:
    """HF's GDN grouping: (key heads nk, key dim dk, value heads per key head r, value dim dv)."""
    return (
        cfg.linear_num_key_heads,
        cfg.linear_key_head_dim,
        cfg.linear_num_value_heads // cfg.linear_num_key_heads,
        cfg.linear_value_head_dim,
    )


def _deinterleave_qkvz(w, cfg):
    """[nk*(2dk+2r*dv), Hd] grouped per key head -> (w_qkv [C, Hd], w_z [nv*dv, Hd])."""
    nk, dk, r, dv = _qkvz_layout(cfg)
    g = w.reshape(nk, 2 * dk + 2 * r * dv, -1)
    q, k = g[:, :dk], g[:, dk : 2 * dk]
    v, z = g[:, 2 * dk : 2 * dk + r * dv], g[:, 2 * dk + r * dv :]
    flat = lambda x: x.reshape(-1, w.shape[-1])
    return np.concatenate([flat(q), flat(k), flat(v)]), flat(z)


def _interleave_qkvz(w_qkv, w_z, cfg):
    nk, dk, r, dv = _qkvz_layout(cfg)
    hd = w_qkv.shape[-1]
    kd = nk * dk
    q = w_qkv[:kd].reshape(nk, dk, hd)
    k = w_qkv[kd : 2 * kd].reshape(nk, dk, hd)
    v = w_qkv[2 * kd :].reshape(nk, r * dv, hd)
    z = w_z.reshape(nk, r * dv, hd)
    return np.concatenate([q, k, v, z], axis=1).reshape(-1, hd)


def _deinterleave_ba(w, cfg):
    nk, _, r, _ = _qkvz_layout(cfg)
    g = w.reshape(nk, 2 * r, -1)
    return g[:, :r].reshape(-1, w.shape[-1]), g[:, r:].reshape(-1, w.shape[-1])


def _interleave_ba(w_b, w_a, cfg):
    nk, _, r, _ = _qkvz_layout(cfg)
    hd = w_b.shape[-1]
    return np.concatenate([w_b.reshape(nk, r, hd), w_a.reshape(nk, r, hd)], axis=1).reshape(-1, hd)


def _split_rows(w, rows) -> list:
    return np.split(w, np.cumsum(rows)[:-1])


def _stacked(path, names, shapes) -> Binding:
    """One leaf made of several HF tensors stacked by rows, in `names` order."""
    return Binding(
        path,
        tuple(names),
        tuple(shapes),
        lambda a: np.concatenate(list(a)),
        lambda w: _split_rows(w, [s[0] for s in shapes]),
    )


def _gdn_in_binding(cfg: ModelConfig, path: tuple, la: str, hd: int) -> Binding:
    """The GDN `w_in` leaf: four tensors (Qwen3.5), or Qwen3-Next's two fused ones interleaved
    per key head."""
    rows = gdn_in_rows(cfg)
    if cfg.weight_layout != "qwen3_next":
        return _stacked(path, [f"{la}.in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")], [(r, hd) for r in rows])

    def split(w):
        qkv, z, b, a = _split_rows(w, rows)
        return [_interleave_qkvz(qkv, z, cfg), _interleave_ba(b, a, cfg)]

    return Binding(
        path,
        (f"{la}.in_proj_qkvz.weight", f"{la}.in_proj_ba.weight"),
        ((rows[0] + rows[1], hd), (rows[2] + rows[3], hd)),
        lambda a: np.concatenate([*_deinterleave_qkvz(a[0], cfg), *_deinterleave_ba(a[1], cfg)]),
        split,
    )


def _layer_bindings(cfg: ModelConfig, spec: dict, path: tuple, prefix: str, kind: str, fused_experts: bool):
    hd = cfg.hidden_size
    out = [
        _one(path + ("input_norm",), f"{prefix}.input_layernorm.weight", spec["input_norm"].shape),
        _one(path + ("post_norm",), f"{prefix}.post_attention_layernorm.weight", spec["post_norm"].shape),
    ]
    if kind == FULL:
        a, p, sa = spec["attn"], path + ("attn",), f"{prefix}.self_attn"
        out.append(
            _stacked(p + ("w_in",), [f"{sa}.{x}_proj.weight" for x in "qkv"], [(r, hd) for r in attn_in_rows(cfg)])
        )
        for leaf, hf in (("wo", "o_proj"), ("q_norm", "q_norm"), ("k_norm", "k_norm")):
            out.append(_one(p + (leaf,), f"{sa}.{hf}.weight", a[leaf].shape))
    else:
        s, p, la = spec["gdn"], path + ("gdn",), f"{prefix}.linear_attn"
        out.append(_gdn_in_binding(cfg, p + ("w_in",), la, hd))
        c, kc = s["conv"].shape
        out.append(
            _one(p + ("conv",), f"{la}.conv1d.weight", (c, 1, kc), lambda x: x[:, 0, :], lambda w: w[:, None, :])
        )
        for leaf, hf in (
            ("dt_bias", "dt_bias"),
            ("A_log", "A_log"),
            ("norm", "norm.weight"),
            ("out", "out_proj.weight"),
        ):
            out.append(_one(p + (leaf,), f"{la}.{hf}", s[leaf].shape))
    m, mp, pm = spec["mlp"], path + ("mlp",), f"{prefix}.mlp"
    if "shared_down" in m:
        e, two_i, _ = m["gate_up"].shape
        i = two_i // 2
        names: tuple[str, ...] = (f"{pm}.gate.weight", f"{pm}.shared_expert_gate.weight")
        out.append(_stacked(mp + ("router",), names, [(r, hd) for r in moe_router_rows(cfg)]))
        names = (f"{pm}.shared_expert.gate_proj.weight", f"{pm}.shared_expert.up_proj.weight")
        out.append(_stacked(mp + ("shared_gate_up",), names, [(r, hd) for r in shared_in_rows(cfg)]))
        if fused_experts:
            out.append(_one(mp + ("gate_up",), f"{pm}.experts.gate_up_proj", (e, two_i, hd)))
            out.append(_one(mp + ("down",), f"{pm}.experts.down_proj", m["down"].shape))
        else:
            names = tuple(f"{pm}.experts.{x}.{w}_proj.weight" for x in range(e) for w in ("gate", "up"))
            out.append(
                Binding(
                    mp + ("gate_up",),
                    names,
                    ((i, hd),) * (2 * e),
                    lambda a: np.stack([np.concatenate([a[2 * x], a[2 * x + 1]]) for x in range(e)]),
                    lambda w: [part for x in w for part in (x[:i], x[i:])],
                )
            )
            names = tuple(f"{pm}.experts.{x}.down_proj.weight" for x in range(e))
            out.append(Binding(mp + ("down",), names, ((hd, i),) * e, lambda a: np.stack(list(a)), lambda w: list(w)))
        out.append(_one(mp + ("shared_down",), f"{pm}.shared_expert.down_proj.weight", m["shared_down"].shape))
    else:
        out.append(
            _stacked(
                mp + ("gate_up",),
                [f"{pm}.gate_proj.weight", f"{pm}.up_proj.weight"],
                [(r, hd) for r in dense_in_rows(cfg)],
            )
        )
        out.append(_one(mp + ("down",), f"{pm}.down_proj.weight", m["down"].shape))
    return out


def bindings(cfg: ModelConfig, fused_experts: bool | None = None) -> list[Binding]:
    """Every parameter leaf of `cfg` bound to its HF tensor names."""
    if fused_experts is None:
        fused_experts = cfg.weight_layout == "qwen3_5"
    spec = param_specs(cfg)
    tp = cfg.trunk_prefix
    out = [
        _one(("embed",), f"{tp}.embed_tokens.weight", spec["embed"].shape),
        _one(("final_norm",), f"{tp}.norm.weight", spec["final_norm"].shape),
    ]
    if "lm_head" in spec:
        out.append(_one(("lm_head",), "lm_head.weight", spec["lm_head"].shape))
    for i, kind in enumerate(cfg.layer_types):
        out += _layer_bindings(cfg, spec["layers"][i], ("layers", i), f"{tp}.layers.{i}", kind, fused_experts)
    if "mtp" in spec:
        m = spec["mtp"]
        out += [
            _one(("mtp", "fc"), "mtp.fc.weight", m["fc"].shape),
            _one(("mtp", "norm_embedding"), "mtp.pre_fc_norm_embedding.weight", m["norm_embedding"].shape),
            _one(("mtp", "norm_hidden"), "mtp.pre_fc_norm_hidden.weight", m["norm_hidden"].shape),
            _one(("mtp", "norm"), "mtp.norm.weight", m["norm"].shape),
        ]
        for j, ls in enumerate(m["layers"]):
            out += _layer_bindings(cfg, ls, ("mtp", "layers", j), f"mtp.layers.{j}", FULL, fused_experts)
    return out


def _assign(tree, path, value):
    *head, last = path
    node = tree
    for k in head:
        node = node[k]
    node[last] = value


def _get(tree, path):
    node = tree
    for k in path:
        node = node[k]
    return node


def _empty_tree(spec):
    if isinstance(spec, dict):
        return {k: _empty_tree(v) for k, v in spec.items()}
    if isinstance(spec, list):
        return [_empty_tree(v) for v in spec]
    return None


# ---------------------------------------------------------------- load / save


_IGNORED = re.compile(r"^(model\.visual\.|visual\.)")


def _mtp_layers_present(names) -> int:
    ids = {int(m.group(1)) for n in names if (m := re.match(r"^mtp\.layers\.(\d+)\.", n))}
    return max(ids) + 1 if ids else 0


_FP8 = "F8_E4M3"


def stored_names(b: Binding, refs: dict[str, TensorRef]) -> list[str]:
    """Every checkpoint tensor binding `b` reads: its names and each FP8 one's block scale."""
    return [m for n in b.names for m in ([n, scale_name(n)] if refs[n].dtype == _FP8 else [n])]


def fp8_rows(b: Binding, is_fp8: Callable[[str], bool]) -> np.ndarray:
    """Per row of `b`'s assembled leaf (leading axes dropped): whether it comes from a tensor
    `is_fp8` names (the binding's own assembly run on one-column markers; no tensor is read)."""
    marks = [np.full((*shape[:-1], 1), is_fp8(n)) for n, shape in zip(b.names, b.shapes)]
    m = np.asarray(b.assemble(marks))[..., 0]
    return m.reshape(-1, m.shape[-1])[0]


def _fp8_rows(b: Binding, refs: dict[str, TensorRef]) -> np.ndarray:
    return fp8_rows(b, lambda n: refs[n].dtype == _FP8)


def _fp8_problems(b: Binding, refs: dict[str, TensorRef], q: Quantization | None, kind: str) -> list[str]:
    """What makes the FP8 tensors of binding `b` unloadable: no fp8 scheme, a leaf served at full
    precision only, a missing or mis-shaped scale, or kept rows not after the converted ones."""
    fp8 = [n for n in b.names if n in refs and refs[n].dtype == _FP8]
    if not fp8:
        return []
    if q is None or not q.loadable:
        return [f"tensor {fp8[0]} is {_FP8} but config.json declares no fp8 quantization_config"]
    if kind != "linear":
        return [f"tensor {n} is {_FP8}; a {kind} parameter is served at full precision only" for n in fp8]
    problems = []
    for n in fp8:
        s, want = scale_name(n), scale_shape(refs[n].shape, q.block)
        if s not in refs:
            problems.append(f"FP8 tensor {n} has no scale {s}")
        elif refs[s].shape != want:
            problems.append(
                f"scale {s} has shape {list(refs[s].shape)}, expected {list(want)} "
                f"({q.block[0]}x{q.block[1]} blocks of {list(refs[n].shape)})"
            )
        elif refs[s].dtype not in _FLOAT:
            problems.append(f"scale {s} has dtype {refs[s].dtype}, expected a float dtype")
    rows = _fp8_rows(b, refs)
    if not problems and not rows[: int(rows.sum())].all():
        problems.append(f"{b.names[0]}: the rows kept at full precision must follow the FP8 rows in its leaf")
    return problems


def plan_load(
    cfg: ModelConfig, refs: dict[str, TensorRef], quant: Quantization | None = None
) -> tuple[ModelConfig, list[Binding]]:
    """Check a checkpoint's headers against `cfg` (and its weight format `quant`); return the
    (possibly MTP-completed) config and bindings. Raises CheckpointError listing every missing,
    unexpected, mis-shaped or non-float tensor, every FP8 tensor without its block scale or with
    a scale of the wrong block shape; FP8 tensors without an fp8 scheme are one line."""
    names = set(refs)
    if quant is None and any(r.dtype == _FP8 for r in refs.values()):
        first = min(n for n, r in refs.items() if r.dtype == _FP8)
        raise CheckpointError(
            f"tensor {first} (and every other {_FP8} one) is FP8 but config.json declares no fp8 quantization_config"
        )
    if cfg.num_mtp_layers == 0 and "mtp.fc.weight" in names:
        # Qwen3-Next's release config has no MTP field; the checkpoint says how many layers it has.
        cfg = cfg.replace(num_mtp_layers=_mtp_layers_present(names))
    fused = any(".mlp.experts.gate_up_proj" in n for n in names)
    binds = bindings(cfg, fused_experts=fused)
    specs = param_specs(cfg)
    problems, used = [], set()
    for b in binds:
        for name, shape in zip(b.names, b.shapes):
            used.add(name)
            ref = refs.get(name)
            if ref is None:
                problems.append(f"missing tensor {name}")
            elif ref.shape != shape:
                problems.append(f"tensor {name} has shape {list(ref.shape)}, expected {list(shape)}")
            elif ref.dtype not in _FLOAT and ref.dtype != _FP8:
                problems.append(f"tensor {name} has dtype {ref.dtype}, expected a float dtype")
            elif ref.dtype == _FP8:
                used.add(scale_name(name))
        if not problems:
            problems += _fp8_problems(b, refs, quant, _get(specs, b.path).kind)
    extra = sorted(n for n in names - used if not _IGNORED.match(n))
    problems += [f"unexpected tensor {n}" for n in extra]
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise CheckpointError(f"checkpoint does not match the config ({len(problems)} problem(s)): " + "; ".join(shown))
    return cfg, binds


#: The compute dtypes a checkpoint may declare and be served in, by config.json name.
SERVED_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def declared_dtype(raw: Mapping[str, Any]) -> str | None:
    """The compute dtype a config.json dict declares (`dtype` or `torch_dtype`, top level first,
    then `text_config`), when it is one of `SERVED_DTYPES`; else None. The checkpoint's own dtype:
    what every command serves it in unless told otherwise."""
    for table in (raw, raw.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            if isinstance(table, Mapping) and table.get(key) in SERVED_DTYPES:
                return table[key]
    return None


def _config_json(directory: str) -> dict:
    """The raw config.json of a checkpoint directory (load_model_config has validated it)."""
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def load_checkpoint(directory: str, dtype=None) -> tuple[ModelConfig, dict]:
    """Load config.json + safetensors from `directory`. dtype: cast every float tensor to it
    (default: the checkpoint's own, `declared_dtype` of its config.json; when that declares none,
    each tensor keeps its stored dtype). Everything cheap (the config, every header against the
    config) is checked before any tensor is read; tensors are then read one leaf at a time from
    memory maps and cast leaf by leaf, so no full-precision copy of the model is ever held."""
    try:
        cfg = load_model_config(directory)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    raw = _config_json(directory)
    if dtype is None:
        own = declared_dtype(raw)
        dtype = None if own is None else SERVED_DTYPES[own]
    try:
        quant = read_quantization(directory, raw)
    except QuantizationError as e:
        raise CheckpointError(str(e)) from None
    if quant is not None and not quant.loadable:
        raise CheckpointError(f"{quant.method} checkpoints are planned by `memory` but not loaded (loadable: fp8)")
    refs = index_checkpoint(directory)
    cfg, binds = plan_load(cfg, refs, quant)
    tree = _empty_tree(param_specs(cfg))
    cast = (lambda a: a) if dtype is None else (lambda a: np.asarray(a).astype(dtype, copy=False))
    for b in binds:
        if any(refs[n].dtype == _FP8 for n in b.names):
            assert quant is not None  # plan_load refuses FP8 tensors without a scheme
            _assign(tree, b.path, _fp8_leaf(b, refs, quant.block, cast))
        else:
            _assign(tree, b.path, jnp.asarray(cast(b.assemble([refs[n].read() for n in b.names]))))
    return cfg, tree


def _run_scale(per_row: np.ndarray, block_rows: int) -> tuple[np.ndarray, int]:
    """Per-row scales [..., rows, nj] as one scale per run of g rows, g the largest divisor of
    `block_rows` over whose runs every scale is constant: ([..., ceil(rows / g), nj], g). A leaf
    stacked from parts of whole blocks keeps the file's blocks (g = block_rows)."""
    rows = per_row.shape[-2]
    for g in (d for d in range(block_rows, 1, -1) if block_rows % d == 0):
        pad = (-rows) % g
        padded = np.concatenate([per_row, np.repeat(per_row[..., -1:, :], pad, axis=-2)], axis=-2)
        runs = padded.reshape(*per_row.shape[:-2], -1, g, per_row.shape[-1])
        if (runs == runs[..., :1, :]).all():
            return runs[..., 0, :], g
    return per_row, 1


def _fp8_leaf(b: Binding, refs: dict[str, TensorRef], block: tuple[int, int], cast) -> Fp8BlockWeight:
    """The `Fp8BlockWeight` of a binding with FP8 tensors (plan_load has checked every scale and
    that the full-precision rows come last). The values, the scales expanded to one per row, and
    the full-precision tensors are each assembled by the binding's own assembly (zeros standing in
    for the other kind), then the scales folded back to runs of rows (`_run_scale`)."""
    values: list[np.ndarray] = []
    scales: list[np.ndarray] = []
    kept: list[np.ndarray | None] = []
    scale_dtype = next(_DTYPES[refs[scale_name(n)].dtype] for n in b.names if refs[n].dtype == _FP8)
    for n, shape in zip(b.names, b.shapes):
        cols = -(-shape[-1] // block[1])
        if refs[n].dtype == _FP8:
            values.append(refs[n].read())
            per_row = np.repeat(refs[scale_name(n)].read(), block[0], axis=-2)[..., : shape[-2], :]
            scales.append(per_row)
            kept.append(None)
        else:
            values.append(np.zeros(shape, FP8_DTYPE))
            scales.append(np.zeros((*shape[:-1], cols), scale_dtype))
            kept.append(refs[n].read())
    n_fp8 = int(_fp8_rows(b, refs).sum())
    q = np.asarray(b.assemble(values))[..., :n_fp8, :]
    scale, g = _run_scale(np.asarray(b.assemble(scales))[..., :n_fp8, :], block[0])
    tail = None
    if any(k is not None for k in kept):
        stand_in = next(k for k in kept if k is not None).dtype
        full = b.assemble([np.zeros(s, stand_in) if k is None else k for k, s in zip(kept, b.shapes)])
        tail = jnp.asarray(cast(np.asarray(full)[..., n_fp8:, :]))
    return Fp8BlockWeight(jnp.asarray(e4m3_bits(q)), jnp.asarray(scale), tail, (g, block[1]))


def save_checkpoint(directory: str, cfg: ModelConfig, params: dict) -> None:
    """Write config.json + model.safetensors in `cfg`'s checkpoint layout."""
    os.makedirs(directory, exist_ok=True)
    tensors = {}
    for b in bindings(cfg):
        for name, arr in zip(b.names, b.split(np.asarray(_get(params, b.path)))):
            tensors[name] = np.ascontiguousarray(arr)
    write_safetensors(os.path.join(directory, "model.safetensors"), tensors)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f, indent=2)
