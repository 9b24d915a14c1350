"""Paged attention's public entry points: pick the Pallas kernel or the reference, explain refusals,
and declare the kernel's contract against `kernels_pallas.paged_attention.reference`.

Owns: which shapes and backends the attention kernel accepts (`paged_attention_supported` returns
a human-readable reason or None), its default tiling, the contract below, and the KV write's
implementation choice.

KV write: `write_kv` is the reference's jnp scatter, on every backend, by design. It moves only
the T rows it writes (with the pool donated, XLA updates it in place); a Pallas kernel would have to
alias the whole pool through input_output_aliases to do the same and could not move fewer bytes.

Contract (checked by tests/test_kernels_paged_attention.py): BOUNDED, not bit-identical.
- Why: the reference normalises each row's softmax over the whole table span before the PV
  product and rounds the normalised probabilities to q's dtype; a kernel that walks the cache in
  tiles (online softmax) rounds unnormalised probabilities and sums the span tile by tile. Making
  it byte-equal would need a reference that itself runs the tiled online softmax.
- Bound: `common.contract_bound` (twice the reference's own error against the float64 numpy
  oracle of the same dtype-rounded inputs, plus one unit roundoff of q's dtype; metric max
  |o - o64| / max |o64|). Measured on CPU (decode, verify and prefill-chunk rows, GQA 2:1 and
  8:1): float32 2.7e-7 (reference 2.8e-7); bfloat16 5.8e-3 (reference 5.8e-3; both are dominated
  by rounding the scores to bfloat16, which the kernel does as the reference does).
- Exact parts: padding rows are zeros, and what other sequences' blocks, or blocks of the own table
  past the rows' positions, hold never changes a result (tests use NaN there).
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas import common
from kernels_pallas.common import KernelRefused
from kernels_pallas.paged_attention import pallas_gpu, reference

CONTRACT = "bounded"
WHY_NOT_BIT_IDENTICAL = "online softmax over key tiles vs the reference's whole-span softmax"

write_kv = reference.write_kv
Q_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
TILE_KEYS = 64  # keys per tile: pages = TILE_KEYS // bs blocks, read per loop step


def default_tiling(t: int, h: int, kvh: int, bs: int) -> tuple[int, int]:
    """(block_rows, pages): rows per program (a power of two in [16, 64] covering T * H / KV
    when it can) and blocks per key tile (TILE_KEYS keys, at least one block)."""
    rows = t * (h // kvh)
    block_rows = min(64, max(16, 1 << (rows - 1).bit_length()))
    return block_rows, max(1, TILE_KEYS // bs)


def paged_attention_supported(q, k_cache, v_cache, block_tables, positions, *, backend: str, block_rows: int | None = None, pages: int | None = None) -> str | None:
    """Why the kernel refuses these arguments (anything with .shape/.dtype) on `backend`
    ("interpret" or "gpu"), or None when it takes them."""
    if reason := common.backend_reason(backend):
        return reason
    if q.ndim != 4 or k_cache.ndim != 4 or v_cache.shape != k_cache.shape:
        return f"q must be [B, T, H, D] and the caches [NB, bs, KV, D] alike; got {q.shape}, {k_cache.shape}, {v_cache.shape}"
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
    block_rows_d, pages_d = default_tiling(t, h, kvh, bs)
    block_rows, pages = block_rows or block_rows_d, pages or pages_d
    if backend == "gpu":
        return common.triton_dims_reason(minimum=16, head_dim=d, block_rows=block_rows, tile_keys=pages * bs) or (
            common.triton_dims_reason(minimum=1, pages=pages)
            or common.int32_offsets_reason(k_cache=k_cache.size, q=b * h * t * d)
        )
    return None


def paged_attention(q, k_cache, v_cache, block_tables, positions, scale: float, *, implementation: str = "pallas", interpret: bool | None = None, block_rows: int | None = None, pages: int | None = None):
    """Causal GQA attention of query rows over their sequences' paged KV. Arguments as
    `reference.paged_attention`; returns [B, T, H, D] in q's dtype.

    implementation: "pallas" (raises `KernelRefused` with the reason when unsupported) or
    "reference". interpret: None = `common.default_interpret()`.
    """
    common.check_implementation(implementation)
    if implementation == "reference":
        return reference.paged_attention(q, k_cache, v_cache, block_tables, positions, scale)
    interpret = common.default_interpret() if interpret is None else interpret
    block_rows_d, pages_d = default_tiling(q.shape[1], q.shape[2], k_cache.shape[2], k_cache.shape[1])
    block_rows, pages = block_rows or block_rows_d, pages or pages_d
    backend = common.backend_of(interpret)
    if reason := paged_attention_supported(q, k_cache, v_cache, block_tables, positions, backend=backend, block_rows=block_rows, pages=pages):
        raise KernelRefused(f"paged attention kernel: {reason}")
    return pallas_gpu.paged_attention(q, k_cache, v_cache, block_tables, positions, scale, block_rows=block_rows, pages=pages, interpret=interpret)
