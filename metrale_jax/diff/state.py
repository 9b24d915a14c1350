"""A sequence's device state as comparable parts, digests of it, and the swap control's change.

Owns: `state_parts` (a `save_sequence_state` record as one part per layer and tensor, in model
layer order, cut to what the sequence owns), `digests`, and `perturbed` (the swap control's
record, with one live element changed).

Invariants:
- Only live positions are compared: KV rows past `seq_len` (and drafter rows past
  `drafter_len`) are junk the engine overwrites before reading, as is the null block a
  null-padded block table gathers.
- Part order is model layer order (GDN h then conv; attention K then V), then the MTP head, so
  the first differing part names the first differing layer.
"""

from __future__ import annotations

import copy
import hashlib

import ml_dtypes
import numpy as np

from metrale_jax.diff.compare import Part


def _positions(kv: np.ndarray, n: int) -> np.ndarray:
    """KV blocks [blocks, bs, heads, dim] as positions [n, heads, dim]."""
    return kv.reshape(-1, *kv.shape[2:])[:n]


def state_parts(cfg, record: dict) -> list[Part]:
    """The parts of a `save_sequence_state` record of a sequence of model `cfg`."""
    dev, n = record["device"], record["seq_len"]
    lin = {layer: j for j, layer in enumerate(cfg.linear_layer_ids)}
    full = {layer: j for j, layer in enumerate(cfg.full_layer_ids)}
    parts = []
    for layer in range(cfg.num_hidden_layers):
        if layer in lin:
            parts += [
                Part(f"layer {layer} gdn h", dev["gdn_h"][lin[layer]], "values"),
                Part(f"layer {layer} gdn conv", dev["gdn_conv"][lin[layer]], "values"),
            ]
        else:
            parts += [
                Part(f"layer {layer} kv {t}", _positions(dev[f"kv_{t}"][full[layer]], n), "values") for t in ("k", "v")
            ]
    if "stash" in dev:
        parts.append(Part("mtp stash", dev["stash"][None], "values"))
        parts += [
            Part(f"mtp layer {m} kv {t}", _positions(dev[f"draft_{t}"][m], record["drafter_len"]), "values")
            for m in range(dev["draft_k"].shape[0])
            for t in ("k", "v")
        ]
    return parts + [Part("tokens", np.asarray(record["tokens"], np.int32), "tokens")]


def digests(parts: list[Part]) -> list[dict]:
    """{part, digest}: the first 16 hex digits of each part's sha256 (shape and dtype included)."""
    out = []
    for p in parts:
        h = hashlib.sha256(f"{p.data.shape}{p.data.dtype}".encode())
        h.update(np.ascontiguousarray(p.data).tobytes())
        out.append({"part": p.name, "digest": h.hexdigest()[:16]})
    return out


def perturbed(record: dict) -> tuple[dict, str]:
    """A copy of `record` with the top mantissa bit of one live element flipped (its value moves
    by a quarter to a half, like the original's 0x40 byte flip): the largest |value| of the
    first GDN layer's h, else the first attention layer's first K element. Returns (record,
    where). One ULP is too weak: the model's rounding downstream can absorb it."""
    rec = copy.deepcopy(record)
    dev = rec["device"]
    if dev["gdn_h"].size:
        target, name = dev["gdn_h"][0], "gdn_h of the first GDN layer"
        i = int(np.abs(target.astype(np.float64)).reshape(-1).argmax())
    else:
        target, name, i = dev["kv_k"][0], "K of the first attention layer", 0
    bit = ml_dtypes.finfo(target.dtype).nmant - 1
    bits = target.reshape(-1).view(np.dtype(f"u{target.dtype.itemsize}"))
    bits[i] ^= bits.dtype.type(1 << bit)
    return rec, f"{name}, element {i}, mantissa bit {bit}"
