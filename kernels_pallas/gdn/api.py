"""The Gated DeltaNet cores' public entry points: pick the Pallas kernel or the reference, explain
refusals, and declare each kernel's contract against `kernels_pallas.gdn.reference`.

Owns: which shapes and backends the Pallas kernels accept (`gdn_chunk_supported`,
`gdn_rows_supported` return a human-readable reason or None) and the contracts below. The math
lives in `reference.py` and `pallas_gpu.py`, the tiling (`RowsTiling`, `ChunkTiling`) in
`pallas_gpu.py`.

Contracts (checked by tests/test_kernels_gdn.py):
- Both kernels are BIT-IDENTICAL to the reference under the CPU interpreter with the default
  tiling (block_v = dv): the kernel bodies run the reference's ops in its order, and the WY
  inverse's forward substitution takes the order LAPACK's trsm takes on CPU.
- What cannot be byte-equal is BOUNDED by `common.contract_bound` (twice the reference's own error
  against the float64 oracle, plus one float32 unit roundoff; metric max |x - x64| / max |x64|
  over o and the state(s)): the Triton body (its matvecs are multiply + sum, reduced in another
  order than the CPU dot) and value tiles narrower than Eigen's wide-matmul path (Eigen switches
  matmul kernels for narrow operands).
- The batch-invariant configuration (`recurrent_gated_delta_rule(..., invariant=True)`, the `pallas`
  forward under `--batch-invariant`): one program per (sequence, value head, value tile) whatever the batch,
  its rows in order through the same step. Under the interpreter the step's matvecs are `invariant_einsum`s
  and each row starts from a fenced state and row (the "invariant" matvec form): row t of a verify has the
  bits of a decode from the state after row t - 1, a sequence the same bits in any batch, and the kernel
  equals the reference's invariant recurrence bit for bit. Compiled, the Triton body ("reduce") already runs
  one fixed program per row. The chunk kernel needs no variant: its shapes are the chunk's whatever the
  prompt or the batch.
- On a GPU the kernels are compared to the reference by `benchmarks/gpu_check.py`, and the tests
  of tests/test_kernels_gdn.py run compiled and check the bounded contract.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import common
from kernels_pallas.common import Implementation
from kernels_pallas.gdn import pallas_gpu, reference
from kernels_pallas.gdn.pallas_gpu import ChunkTiling, RowsTiling

CHUNK_CONTRACT = "bit-identical"
ROWS_CONTRACT = "bit-identical"

MAX_ROWS = 8  # the rows kernel unrolls its rows; decode is 1, verify is drafts + 1


def _common_reason(q, k, v, g, beta, h0, backend: str, block_v: int) -> str | None:
    if reason := common.backend_reason(backend):
        return reason
    if q.ndim != 4 or k.shape != q.shape or v.ndim != 4:
        return f"q, k must be [B, T, Hk, dk] alike and v [B, T, H, dv]; got q {q.shape}, k {k.shape}, v {v.shape}"
    b, t, hk, dk = q.shape
    heads, dv = v.shape[2:]
    if v.shape[:2] != (b, t) or g.shape != (b, t, heads) or beta.shape != (b, t, heads):
        return f"v, g, beta must share q's [B, T]; got v {v.shape}, g {g.shape}, beta {beta.shape}"
    if h0.shape != (b, heads, dk, dv):
        return f"h0 must be [B, H, dk, dv] = {(b, heads, dk, dv)}; got {h0.shape}"
    if heads % hk:
        return f"value heads {heads} are not a multiple of key heads {hk}"
    if t < 1:
        return "no rows"
    if any(x.dtype != jnp.float32 for x in (q, k, v, g, beta, h0)):
        return "the delta rule takes float32 q, k, v, g, beta and state (the reference's contract)"
    if dv % block_v:
        return f"block_v={block_v} does not divide dv={dv}"
    return None


def gdn_rows_supported(q, k, v, g, beta, h0, *, backend: str, tiling: RowsTiling | None = None) -> str | None:
    """Why the rows kernel refuses these arguments (anything with .shape/.dtype) on `backend`
    ("interpret" or "gpu") with `tiling` (None = `RowsTiling.get_default`), or None when it
    takes them."""
    tiling = tiling or RowsTiling.get_default(v.shape[-1], interpret=backend == "interpret")
    if reason := _common_reason(q, k, v, g, beta, h0, backend, tiling.block_v):
        return reason
    b, t, _, dk = q.shape
    if t > MAX_ROWS:
        return f"the rows kernel unrolls at most {MAX_ROWS} rows per sequence; got T={t} (use the chunk kernel)"
    if backend == "gpu":
        # Its matvecs are multiply + sum, so no dot minimum: [dk], [block_v], [dk, block_v] arrays.
        return common.triton_dims_reason(minimum=1, dk=dk, block_v=tiling.block_v) or common.int32_offsets_reason(
            states=b * t * v.shape[2] * dk * v.shape[-1]
        )
    return None


def gdn_chunk_supported(q, k, v, g, beta, h0, *, backend: str, tiling: ChunkTiling | None = None) -> str | None:
    """Why the chunk kernel refuses these arguments on `backend` with `tiling` (None =
    `ChunkTiling.get_default`), or None when it takes them."""
    tiling = tiling or ChunkTiling.get_default(v.shape[-1], interpret=backend == "interpret")
    if reason := _common_reason(q, k, v, g, beta, h0, backend, tiling.block_v):
        return reason
    b, t, _, dk = q.shape
    if backend == "gpu":
        tp = -(-t // tiling.chunk) * tiling.chunk
        return common.triton_dims_reason(
            minimum=16, dk=dk, block_v=tiling.block_v, chunk=tiling.chunk
        ) or common.int32_offsets_reason(o=b * tp * v.shape[2] * v.shape[-1], q=b * tp * q.shape[2] * dk)
    return None


def recurrent_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    h0,
    *,
    implementation: Implementation = "pallas",
    interpret: bool | None = None,
    tiling: RowsTiling | None = None,
    invariant: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Per-row recurrence (decode / verify): (o [B, T, H, dv] f32, states [B, T, H, dk, dv] f32),
    states[:, t] the state after row t. Arguments as `reference.recurrent_gated_delta_rule`.

    implementation: "pallas" (raises `KernelRefused` with the reason when unsupported) or
    "reference". interpret: None = `common.default_interpret()`. tiling: None =
    `RowsTiling.get_default`. invariant: the batch-invariant configuration (see the module docstring);
    the reference is then the reference's invariant recurrence.
    """
    return common.dispatch(
        "gdn rows kernel",
        implementation,
        interpret,
        tiling,
        reference=lambda: reference.recurrent_gated_delta_rule(q, k, v, g, beta, h0, invariant=invariant),
        default_tiling=lambda interp: RowsTiling.get_default(v.shape[-1], interpret=interp),
        supported=lambda backend, til: gdn_rows_supported(q, k, v, g, beta, h0, backend=backend, tiling=til),
        kernel=lambda til, interp: pallas_gpu.recurrent_gated_delta_rule(
            q, k, v, g, beta, h0, tiling=til, interpret=interp, matvec_as="invariant" if invariant and interp else None
        ),
    )


def chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    h0,
    *,
    implementation: Implementation = "pallas",
    interpret: bool | None = None,
    tiling: ChunkTiling | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Chunked prefill: (o [B, T, H, dv] f32, final_state [B, H, dk, dv] f32). Arguments and
    switches as `recurrent_gated_delta_rule`; tiling: None = `ChunkTiling.get_default`."""
    return common.dispatch(
        "gdn chunk kernel",
        implementation,
        interpret,
        tiling,
        reference=lambda: reference.chunk_gated_delta_rule(q, k, v, g, beta, h0),
        default_tiling=lambda interp: ChunkTiling.get_default(v.shape[-1], interpret=interp),
        supported=lambda backend, til: gdn_chunk_supported(q, k, v, g, beta, h0, backend=backend, tiling=til),
        kernel=lambda til, interp: pallas_gpu.chunk_gated_delta_rule(
            q, k, v, g, beta, h0, tiling=til, interpret=interp
        ),
    )
