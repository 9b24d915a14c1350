"""A sequence's device state as comparable parts, digests of it, and the swap control's change.

Owns: `state_parts` (a `save_sequence_state` record as one part per layer and tensor, in model
layer order, cut to what the sequence owns), `settle_pools` (every leaf of two engine pools
compared), `digests`, and `perturbed` (the swap control's record, with one live element changed).

Invariants:
- A record's parts compare only live positions: KV rows past `seq_len` (and drafter rows past
  `drafter_len`) are junk the engine overwrites before reading, as is the null block a
  null-padded block table gathers. `settle_pools` compares everything, junk included: it is for
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
from metrale_jax.diff.compare import Contract, Part, Settled, diff_part
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


def settle_pools(reference, got, contract: Contract) -> Settled:
    """Two `EnginePool`s compared now, leaf by leaf, each leaf a `values` part
    named `pool <leaf path>`. A leaf is read as a host view (no copy on XLA CPU) that does not
    outlive its comparison: neither pool may be donated to a program until this returns."""
    ref, run = _named_leaves(reference), _named_leaves(got)
    if [n for n, _ in ref] != [n for n, _ in run]:
        raise ValueError(f"the pools' leaves differ: {[n for n, _ in ref]} vs {[n for n, _ in run]}")
    diffs = [
        diff_part(Part(name, np.asarray(a), "values"), Part(name, np.asarray(b), "values"), contract)
        for (name, a), (_, b) in zip(ref, run)
    ]
    return Settled(contract, diffs)


def _named_leaves(pool) -> list[tuple[str, object]]:
    """A pool's leaves as (`pool <leaf path>`, leaf)."""
    leaves = jax.tree_util.tree_flatten_with_path(pool)[0]
    return [("pool " + ".".join(str(getattr(k, "name", getattr(k, "key", k))) for k in path), x) for path, x in leaves]


def digests(parts: list[Part]) -> list[dict]:
    """{part, digest}: the first 16 hex digits of each part's sha256 (shape and dtype included)."""
    out = []
    for p in parts:
        h = hashlib.sha256(f"{p.data.shape}{p.data.dtype}".encode())
        h.update(np.ascontiguousarray(p.data).tobytes())
        out.append({"part": p.name, "digest": h.hexdigest()[:16]})
    return out


def _flip(target: np.ndarray, index: tuple[int, ...]) -> None:
    """Flip the top mantissa bit of `target[index]` in place (its value moves by a quarter to a
    half); where that makes the value non-finite (fp8 e4m3's NaN pattern), the next bit down.
    `target`: a C-contiguous array (a view of it would be copied by the reshape)."""
    assert target.flags.c_contiguous
    flat = target.reshape(-1).view(np.dtype(f"u{target.dtype.itemsize}"))
    i = int(np.ravel_multi_index(index, target.shape))
    top = ml_dtypes.finfo(target.dtype).nmant - 1
    for bit in (top, top - 1):
        flat[i] ^= flat.dtype.type(1 << bit)
        if np.isfinite(target.reshape(-1)[i].astype(np.float64)):
            return
        flat[i] ^= flat.dtype.type(1 << bit)
    raise AssertionError("no mantissa bit flips to a finite value")  # unreachable: the lower bit never makes a NaN


def _largest(a: np.ndarray, at: tuple[int, ...], axes: tuple[int, ...]) -> tuple[int, ...]:
    """The index into `a` of the largest |value| (the first on ties) among the elements whose
    indices on `axes` are `at`."""
    lead = tuple(at[axes.index(d)] if d in axes else slice(None) for d in range(a.ndim))
    sub = np.abs(a[lead].astype(np.float64))
    rest = iter(np.unravel_index(int(sub.argmax()), sub.shape))
    return tuple(at[axes.index(d)] if d in axes else int(next(rest)) for d in range(a.ndim))


def perturbed(record: SwapRecord) -> tuple[SwapRecord, str]:
    """A copy of `record` with the top mantissa bit of one live element flipped in every place the
    next decode reads: per GDN layer, the largest |h| of every value head and the largest element
    of every conv-window column; per attention layer, the largest |K| of position 0. Returns
    (record, where).
    NOTE: one element is not enough: a head whose decay underflows to 0 forgets its state at the
    next token, so a change there never reaches the logits (tiny's layer-0 heads 0 and 1: the
    control chosen by `--steps 8` was blind). A state reaches the output through each head
    that keeps it, the conv window through every channel's kernel, the KV through the scores of
    every later query; a control changing all of them is blind only where the model ignores its
    whole state. One ULP would be too weak: the model's rounding can absorb it."""
    dev = jax.tree_util.tree_map(np.array, record.device)  # writable copies
    for layer in range(dev.gdn_h.shape[0]):
        for head in range(dev.gdn_h.shape[1]):
            _flip(dev.gdn_h, _largest(dev.gdn_h, (layer, head), (0, 1)))
        for col in range(dev.gdn_conv.shape[2]):
            _flip(dev.gdn_conv, _largest(dev.gdn_conv, (layer, col), (0, 2)))
    for layer in range(dev.kv_k.shape[0]):
        _flip(dev.kv_k, _largest(dev.kv_k, (layer, 0, 0), (0, 1, 2)))
    where = (
        f"top mantissa bit of the largest |h| of each head and conv column of {dev.gdn_h.shape[0]} GDN layers, "
        f"K at position 0 of {dev.kv_k.shape[0]} attention layers"
    )
    return dataclasses.replace(record, device=dev), where
