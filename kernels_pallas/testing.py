"""Inputs shaped like the engine's and float64 numpy oracles, shared by the kernel tests and
`benchmarks/gpu_check.py`.

Owns: each op's argument shapes as ShapeDtypeStructs (what the `*_supported` checks and export
take), what a "random input" of each op is (never zeros: the L2-normalised q/k, negative log-decays,
betas in (0, 1), ragged and padded batches, non-contiguous block tables), the oracles the
"bounded" contracts are measured against, the error metric, and `assert_contract`: which of a
kernel's two contracts a test checks (byte-equal when interpreted, bounded when compiled).

Invariants: the oracles compute the references' math in float64 from the very same (already
rounded) inputs, with no intermediate rounding; inputs are numpy arrays, deterministic in the rng.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import common


def rel_err(x, oracle) -> float:
    """max |x - oracle| / max |oracle| (float64)."""
    oracle = np.asarray(oracle, np.float64)
    return float(np.abs(np.asarray(x, np.float64) - oracle).max() / np.abs(oracle).max())


def assert_contract(
    out,
    ref,
    oracle: Callable[[], np.ndarray],
    *,
    interpret: bool,
    assert_equal: Callable[[np.ndarray, np.ndarray], None] = np.testing.assert_array_equal,
) -> None:
    """A kernel output `out` against its reference's `ref`: under the interpreter they are equal
    (`assert_equal`); compiled through Triton, out's `rel_err` against the float64 oracle is within
    `common.contract_bound` of the reference's. `oracle()` (the oracle's matching output) runs only
    when compiled."""
    out, ref = np.asarray(out), np.asarray(ref)
    if interpret:
        assert_equal(out, ref)
        return
    o64 = oracle()
    err, err_ref = rel_err(out, o64), rel_err(ref, o64)
    assert err <= common.contract_bound(err_ref, out.dtype), (err, err_ref)


# ---------------------------------------------------------------- Gated DeltaNet


def gdn_abstract_args(b, t, hk, h, dk, dv, dtype=jnp.float32) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The shapes of `gdn_inputs`: (q, k [B, T, Hk, dk], v [B, T, H, dv], g, beta [B, T, H],
    h0 [B, H, dk, dv]), all `dtype`."""
    sds = jax.ShapeDtypeStruct
    qk, gate = sds((b, t, hk, dk), dtype), sds((b, t, h), dtype)
    return qk, qk, sds((b, t, h, dv), dtype), gate, gate, sds((b, h, dk, dv), dtype)


def gdn_inputs(rng, b, t, hk, h, dk, dv, *, initial_state: bool):
    """(q, k [B, T, Hk, dk], v [B, T, H, dv], g, beta [B, T, H], h0 [B, H, dk, dv]), float32 as
    `gdn_math.split_qkv` and `gates` give them; h0 zeros when not `initial_state`."""
    l2 = lambda x: x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)
    q = l2(rng.standard_normal((b, t, hk, dk))) * dk**-0.5
    k = l2(rng.standard_normal((b, t, hk, dk)))
    v = rng.standard_normal((b, t, h, dv))
    g = -np.exp(rng.standard_normal((b, t, h)) - 1.5)
    beta = rng.uniform(0.05, 1.0, (b, t, h))
    h0 = rng.standard_normal((b, h, dk, dv)) * 0.5 if initial_state else np.zeros((b, h, dk, dv))
    return tuple(np.asarray(x, np.float32) for x in (q, k, v, g, beta, h0))


def gdn_pad_rows(args, lens):
    """Rows >= lens[b] made identity rows (k = beta = g = 0), as `gdn_math.mask_rows` pads; q, v
    keep their random values."""
    q, k, v, g, beta, h0 = args
    valid = np.arange(q.shape[1])[None, :] < np.asarray(lens)[:, None]  # [B, T]
    return (
        q,
        np.where(valid[..., None, None], k, 0.0).astype(np.float32),
        v,
        np.where(valid[..., None], g, 0.0).astype(np.float32),
        np.where(valid[..., None], beta, 0.0).astype(np.float32),
        h0,
    )


def gdn_oracle(q, k, v, g, beta, h0):
    """Token recurrence in float64: (o [B, T, H, dv], states [B, T, H, dk, dv])."""
    r = v.shape[2] // q.shape[2]
    q, k = (np.repeat(np.asarray(x, np.float64), r, axis=2) for x in (q, k))
    v, g, beta = (np.asarray(x, np.float64) for x in (v, g, beta))
    s = np.asarray(h0, np.float64)
    outs, states = [], []
    for t in range(q.shape[1]):
        s = s * np.exp(g[:, t])[..., None, None]
        delta = (v[:, t] - np.einsum("bhkv,bhk->bhv", s, k[:, t])) * beta[:, t][..., None]
        s = s + k[:, t][..., :, None] * delta[..., None, :]
        outs.append(np.einsum("bhkv,bhk->bhv", s, q[:, t]))
        states.append(s)
    return np.stack(outs, 1), np.stack(states, 1)


def gdn_oracles(args, *, chunk: bool) -> tuple[Callable[[], np.ndarray], Callable[[], np.ndarray]]:
    """The float64 oracle's outputs for `args` matching a kernel's, as `assert_contract` takes them:
    thunks of (o, final state) for the chunk form (`chunk`) or (o, states) for the rows form. The
    oracle runs once, at the first call."""
    oracle = functools.cache(lambda: gdn_oracle(*args))
    return (lambda: oracle()[0], lambda: oracle()[1][:, -1] if chunk else oracle()[1])


# ---------------------------------------------------------------- paged attention


def attention_abstract_args(b, t, h, kvh, d, *, bs, nb, mb, dtype=jnp.bfloat16) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The shapes of `attention_inputs`: (q [B, T, H, D], k_cache, v_cache [NB, bs, KV, D] in
    `dtype`, block_tables [B, MB] int32, positions [B, T] int32)."""
    sds = jax.ShapeDtypeStruct
    pool = sds((nb, bs, kvh, d), dtype)
    return sds((b, t, h, d), dtype), pool, pool, sds((b, mb), jnp.int32), sds((b, t), jnp.int32)


def attention_inputs(rng, dtype, *, b, t, h, kvh, d, bs, nb, mb, starts):
    """(q [B, T, H, D], k_cache, v_cache [NB, bs, KV, D], block_tables [B, MB] int32,
    positions [B, T] int32) with q and the caches rounded to `dtype` (numpy, via ml_dtypes).

    Sequence i's rows sit at positions starts[i] .. starts[i] + T - 1; a start < 0 makes the
    sequence all padding (-1), and `starts[i] = (s, n)` keeps only its first n rows (the rest -1).
    Block tables are disjoint random (non-contiguous) permutations of the pool's blocks.
    """
    q = rng.standard_normal((b, t, h, d)).astype(dtype)
    k_cache = rng.standard_normal((nb, bs, kvh, d)).astype(dtype)
    v_cache = rng.standard_normal((nb, bs, kvh, d)).astype(dtype)
    tables = rng.permutation(nb)[: b * mb].reshape(b, mb).astype(np.int32)
    positions = np.full((b, t), -1, np.int32)
    for i, start in enumerate(starts):
        s, n = start if isinstance(start, tuple) else (start, t)
        if s >= 0:
            positions[i, :n] = s + np.arange(n)
    return q, k_cache, v_cache, tables, positions


def attention_oracle(q, k_cache, v_cache, block_tables, positions, scale):
    """Causal GQA softmax attention in float64 over each row's keys 0..position; padding rows 0."""
    q, k_cache, v_cache = (np.asarray(x, np.float64) for x in (q, k_cache, v_cache))
    b, t, h, d = q.shape
    nb, bs, kvh, _ = k_cache.shape
    rep = h // kvh
    out = np.zeros_like(q)
    for i in range(b):
        keys = k_cache[block_tables[i]].reshape(-1, kvh, d)[:, np.arange(h) // rep]  # [S, H, D]
        vals = v_cache[block_tables[i]].reshape(-1, kvh, d)[:, np.arange(h) // rep]
        for j in range(t):
            p = positions[i, j]
            if p < 0:
                continue
            s = np.einsum("hd,shd->hs", q[i, j], keys[: p + 1]) * scale
            e = np.exp(s - s.max(axis=1, keepdims=True))
            out[i, j] = np.einsum("hs,shd->hd", e / e.sum(axis=1, keepdims=True), vals[: p + 1])
    return out
