"""Paged attention's public entry points: pick the Pallas kernel or the reference, explain refusals,
and declare the kernel's contract against `kernels_pallas.paged_attention.reference`.

Owns: which shapes and backends the attention kernel accepts (`paged_attention_supported` returns
a human-readable reason or None), the contract below, and the KV write's implementation choice.
The tiling (`AttentionTiling`) and the body's forms live in `pallas_gpu.py`.

KV write: `write_kv` is the reference's jnp scatter, on every backend, by design. It moves only
the T rows it writes (with the pool donated, XLA updates it in place); a Pallas kernel would have to
alias the whole pool through input_output_aliases to do the same and could not move fewer bytes.

Contract (checked by tests/test_kernels_paged_attention.py; in the engine by
tests/test_forward_select.py): BIT-IDENTICAL to the reference under the CPU interpreter with the
default tiling (all rows of a (sequence, kv head) in one program, at least `reference.MIN_ROWS`;
key tiles of `reference.tile_pages(bs)` blocks) and the default form ("reference").
- Why it holds: the reference is the kernel's loop (the same key tiles, the same [M, D] row
  matrices, the same per-tile ops in the same order and dtypes, stopping at the same tile per
  sequence), and the three ops whose CPU bits depend on more than their own operands are avoided
  or matched: the tile's probability sum is a tree of elementwise adds
  (`reductions.pairwise_sum`; XLA CPU's reduce order changes with the array size), the dots take
  float32-widened operands (`reference.widen`; exact products, so the same dot, and XLA CPU's
  bfloat16 dots sum in an order that changes with the surrounding program), and every dot has
  the kernel's M (XLA CPU dots are not M-invariant; a one-row dot is a vector product, so a lone
  row is padded to MIN_ROWS).
- BOUNDED by `common.contract_bound` instead (twice the reference's own error against the float64
  numpy oracle of the same dtype-rounded inputs, plus one unit roundoff of q's dtype; metric
  max |o - o64| / max |o64|): the "triton" form (tl.sum, q-dtype dots) and row blocks narrower
  than a kv head's rows (the GPU tiling: 16 to 64 rows, padded). On a GPU the kernel is compared
  to the reference by `benchmarks/gpu_check.py`, and tests/test_kernels_paged_attention.py runs
  compiled and checks this contract.
- The reference's own accuracy: as good as the whole-span softmax it is the tiled form of, against
  the float64 oracle over decode, verify and prefill-chunk rows spanning 1 to 3 key tiles (GQA
  2:1, 8:1, MHA), in RMS and in max error (tests/test_kernels_paged_attention.py).
- The batch-invariant configuration (`invariant=True`, the `pallas` forward under `--batch-invariant`):
  rows in blocks of `pallas_gpu.INVARIANT_BLOCK_ROWS` whatever the query count (`AttentionTiling.get_invariant`),
  key tiles from key 0 in order, each block walking to its own rows' last key (a tile past a row's position
  adds exact zeros and rescales by exactly 1). Under the interpreter the "invariant" form's products are
  `invariant_einsum`s and the running max is `reductions.fenced`: a row's output has the same bits alone, at
  any place among any rows, with padding after it, and equals the reference's invariant walk
  (`reference.paged_attention(..., invariant=True)`) bit for bit. Compiled, the form is "triton" in the fixed
  row blocks: by construction the same program for a row whatever the query count (not checked here).
- Exact parts on every tiling and form: padding rows are zeros, and what other sequences' blocks,
  or blocks of the own table past the rows' positions, hold never changes a result (tests use NaN
  there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import common
from kernels_pallas.common import Implementation
from kernels_pallas.paged_attention import pallas_gpu, reference
from kernels_pallas.paged_attention.pallas_gpu import AttentionTiling, Form

CONTRACT = "bit-identical"

write_kv = reference.write_kv
Q_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
TILE_KEYS = reference.TILE_KEYS


def paged_attention_supported(
    q,
    k_cache,
    v_cache,
    block_tables,
    positions,
    *,
    backend: str,
    tiling: AttentionTiling | None = None,
    invariant: bool = False,
) -> str | None:
    """Why the kernel refuses these arguments (anything with .shape/.dtype) on `backend`
    ("interpret" or "gpu") with `tiling` (None = `AttentionTiling.get_default`, with `invariant`
    `AttentionTiling.get_invariant`), or None when it takes them."""
    if reason := common.backend_reason(backend):
        return reason
    if q.ndim != 4 or k_cache.ndim != 4 or v_cache.shape != k_cache.shape:
        return (
            "q must be [B, T, H, D] and the caches [NB, bs, KV, D] alike; "
            f"got {q.shape}, {k_cache.shape}, {v_cache.shape}"
        )
    b, t, h, d = q.shape
    nb, bs, kvh, dc = k_cache.shape
    if dc != d:
        return f"head dims differ: q {d}, cache {dc}"
    if h % kvh:
        return f"query heads {h} are not a multiple of kv heads {kvh}"
    if block_tables.ndim != 2 or block_tables.shape[0] != b or positions.shape != (b, t):
        return f"block_tables must be [B, MB] and positions [B, T]; got {block_tables.shape}, {positions.shape}"
    if q.dtype not in Q_DTYPES:
        return f"q dtype {q.dtype} is not one of {[str(x) for x in Q_DTYPES]}"
    tiling = tiling or _default_tiling(t, h, kvh, bs, interpret=backend == "interpret", invariant=invariant)
    if backend == "gpu":
        return common.triton_dims_reason(
            minimum=16, head_dim=d, block_rows=tiling.block_rows, tile_keys=tiling.pages * bs
        ) or (
            common.triton_dims_reason(minimum=1, pages=tiling.pages)
            or common.int32_offsets_reason(k_cache=k_cache.size, q=b * h * t * d)
        )
    return None


def paged_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    positions,
    scale: float,
    *,
    implementation: Implementation = "pallas",
    interpret: bool | None = None,
    tiling: AttentionTiling | None = None,
    form: Form | None = None,
    invariant: bool = False,
) -> jax.Array:
    """Causal GQA attention of query rows over their sequences' paged KV. Arguments as
    `reference.paged_attention`; returns [B, T, H, D] in q's dtype.

    implementation: "pallas" (raises `KernelRefused` with the reason when unsupported) or
    "reference". interpret: None = `common.default_interpret()`. tiling: None =
    `AttentionTiling.get_default`; form: the kernel body's form, None = `pallas_gpu.default_form(interpret)`.
    invariant: the batch-invariant configuration (see the module docstring): tiling None =
    `AttentionTiling.get_invariant`, form None = `pallas_gpu.invariant_form(interpret)`, and the reference
    is the reference's invariant walk.
    """
    return common.dispatch(
        "paged attention kernel",
        implementation,
        interpret,
        tiling,
        reference=lambda: reference.paged_attention(
            q, k_cache, v_cache, block_tables, positions, scale, invariant=invariant
        ),
        default_tiling=lambda interp: _default_tiling(
            q.shape[1], q.shape[2], k_cache.shape[2], k_cache.shape[1], interpret=interp, invariant=invariant
        ),
        supported=lambda backend, til: paged_attention_supported(
            q, k_cache, v_cache, block_tables, positions, backend=backend, tiling=til, invariant=invariant
        ),
        kernel=lambda til, interp: pallas_gpu.paged_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            positions,
            scale,
            tiling=til,
            interpret=interp,
            form=form or (pallas_gpu.invariant_form(interp) if invariant else None),
        ),
    )


def _default_tiling(t: int, h: int, kvh: int, bs: int, *, interpret: bool, invariant: bool) -> AttentionTiling:
    """`AttentionTiling.get_invariant` in the batch-invariant configuration, else `AttentionTiling.get_default`."""
    return (
        AttentionTiling.get_invariant(bs)
        if invariant
        else AttentionTiling.get_default(t, h, kvh, bs, interpret=interpret)
    )
