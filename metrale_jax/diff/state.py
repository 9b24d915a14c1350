"""A sequence's device state as comparable parts, digests of it, and the swap control's change.

Owns: `state_parts` (a `save_sequence_state` record as one part per layer and tensor, in model
layer order, cut to what the sequence owns), `pool_parts` (every leaf of the engine's whole
pool), `digests`, and `perturbed` (the swap control's record, with one live element changed).

Invariants:
- A record's parts compare only live positions: KV rows past `seq_len` (and drafter rows past
  `drafter_len`) are junk the engine overwrites before reading, as is the null block a
  null-padded block table gathers. `pool_parts` compares everything, junk included: it is for
  two runs of one step from one pool.
- Part order is model layer order (GDN h then conv; attention K then V), then the MTP head, so
  the first differing part names the first differing layer.
"""

from __future__ import annotations

import dataclasses
import hashlib

import jax
import ml_dtypes
import numpy as np

from metrale_jax.config import ModelConfig
from metrale_jax.diff.compare import Part
from metrale_jax.engine.inputs import SwapRecord


def _positions(kv: np.ndarray, n: int) -> np.ndarray:
    """KV blocks [blocks, bs, heads, dim] as positions [n, heads, dim]."""
    return kv.reshape(-1, *kv.shape[2:])[:n]


def state_parts(cfg: ModelConfig, record: SwapRecord) -> list[Part]:
    """The parts of a `save_sequence_state` record of a sequence of model `cfg`."""
    dev, n = record.device, record.seq_len
    lin = {layer: j for j, layer in enumerate(cfg.linear_layer_ids)}
    full = {layer: j for j, layer in enumerate(cfg.full_layer_ids)}
    parts = []
    for layer in range(cfg.num_hidden_layers):
        if layer in lin:
            parts += [
                Part(f"layer {layer} gdn h", dev.gdn_h[lin[layer]], "values"),
                Part(f"layer {layer} gdn conv", dev.gdn_conv[lin[layer]], "values"),
            ]
        else:
            parts += [
                Part(f"layer {layer} kv {t}", _positions(kv[full[layer]], n), "values")
                for t, kv in (("k", dev.kv_k), ("v", dev.kv_v))
            ]
    if dev.stash is not None:
        assert dev.draft_k is not None and dev.draft_v is not None  # saved with the stash
        parts.append(Part("mtp stash", dev.stash[None], "values"))
        parts += [
            Part(f"mtp layer {m} kv {t}", _positions(kv[m], record.drafter_len), "values")
            for m in range(dev.draft_k.shape[0])
            for t, kv in (("k", dev.draft_k), ("v", dev.draft_v))
        ]
    return parts + [Part("tokens", np.asarray(record.tokens, np.int32), "tokens")]


def pool_parts(pool) -> list[Part]:
    """Every leaf of an `EnginePool` as a `values` part named `pool <leaf path>` (host copies:
    the engine's next program takes the pool donated)."""
    leaves = jax.tree_util.tree_flatten_with_path(pool)[0]
    return [
        Part("pool " + ".".join(str(getattr(k, "name", k)) for k in path), np.array(leaf), "values")
        for path, leaf in leaves
    ]


def digests(parts: list[Part]) -> list[dict]:
    """{part, digest}: the first 16 hex digits of each part's sha256 (shape and dtype included)."""
    out = []
    for p in parts:
        h = hashlib.sha256(f"{p.data.shape}{p.data.dtype}".encode())
        h.update(np.ascontiguousarray(p.data).tobytes())
        out.append({"part": p.name, "digest": h.hexdigest()[:16]})
    return out


def perturbed(record: SwapRecord) -> tuple[SwapRecord, str]:
    """A copy of `record` with the top mantissa bit of one live element flipped (its value moves
    by a quarter to a half): the largest |value| of the first GDN layer's h, else the first
    attention layer's first K element. Returns (record, where). NOTE: one ULP is too weak: the
    model's rounding downstream can absorb it."""
    dev = jax.tree_util.tree_map(np.array, record.device)  # writable copies
    if dev.gdn_h.size:
        target, name = dev.gdn_h[0], "gdn_h of the first GDN layer"
        i = int(np.abs(target.astype(np.float64)).reshape(-1).argmax())
    else:
        target, name, i = dev.kv_k[0], "K of the first attention layer", 0
    bit = ml_dtypes.finfo(target.dtype).nmant - 1
    bits = target.reshape(-1).view(np.dtype(f"u{target.dtype.itemsize}"))
    bits[i] ^= bits.dtype.type(1 << bit)
    return dataclasses.replace(record, device=dev), f"{name}, element {i}, mantissa bit {bit}"
