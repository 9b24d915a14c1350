"""The rows kernel's entry point: `rows_matmul(x, t)`, x [..., K] @ t [K, N] for a few rows on XLA's CPU backend.

Owns: `rows_matmul` (the kernel where `rows_matmul_supported` allows it, else the jnp reference),
`rows_matmul_invariant` (the kernel at every row count: the batch-invariant mode's product), where it applies
(`ROWS_MIN`..`ROWS_MAX` rows, weights of `MIN_WEIGHT_BYTES` or more, float32, the CPU), the switch that turns it
off (`DISABLE_ENV`), and the FFI target's registration.

Invariants:
- Same values as `rows_matmul_reference` up to the order of the sum over K (the kernel sums in increasing k, one
  multiply-add at a time); a row's result does not depend on how many rows run with it.
- The kernel lowers only for the CPU (`lax.platform_dependent`): a program lowered for another platform computes
  the reference. Differentiable (a JVP through the reference), and vmappable (row batches run one by one).

NOTE: why a kernel of our own. XLA CPU's product of 2-8 rows with a weight read from memory takes ~2x its one-row
product (`benchmarks small-m-products`), while streaming the weight once for all rows costs little more than one
row: the verify of a speculative step (K = 2-4 rows per sequence, a few sequences) pays that excess on every projection.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp

from kernels_cpu.rows_matmul.build import library
from kernels_cpu.rows_matmul.reference import rows_matmul_reference

#: The rows (the product of x's leading axes) the kernel runs. One row goes to XLA's dot, which streams the weight
#: as fast as the kernel and fuses with its neighbours; more than ROWS_MAX too (the kernel holds at most 8 rows'
#: accumulators in registers and reads the weight again for each further group of 8; still, the 45 M verify of 4 and
#: 8 sequences of K = 4, 16 and 32 rows, ran 1.13x and 1.06x quicker with it than with XLA's dot).
ROWS_MIN, ROWS_MAX = 2, 32
#: The smallest weight the kernel reads. NOTE: a custom call is a launch of its own that XLA cannot fuse with the
#: ops around it; a weight of a few hundred KB is a few microseconds of reading, and in a program of many such
#: products (the `small` preset's, whose weights are at most 200 KB) the kernel made the step slower. From 256 KiB
#: on (the 45 M model's [256, 512] and [512, 512] projections too) it made the 45 M verify faster (BUILD_NOTES).
MIN_WEIGHT_BYTES = 256 << 10
#: Set to 0 to run XLA's dot at every row count (read when a program is traced: set it before the first).
DISABLE_ENV = "METRALE_JAX_ROWS_KERNEL"
TARGET = "metrale_rows_matmul"


@functools.cache
def _registered() -> str | None:
    """Registers the FFI target once per process; the reason it cannot be, or None."""
    lib, reason = library()
    if lib is None:
        return reason
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.MetraleRowsMatmul), platform="cpu")
    return None


def rows_kernel_switched_on() -> bool:
    """Whether `DISABLE_ENV` leaves the kernel on (it is unless set to 0)."""
    return os.environ.get(DISABLE_ENV, "1") != "0"


def rows_matmul_supported(x, t) -> str | None:
    """Why `rows_matmul(x, t)` would run the reference instead of the kernel, or None when it runs the kernel."""
    if not rows_kernel_switched_on():
        return f"turned off ({DISABLE_ENV}=0)"
    reason = _operands_refused(x, t)
    if reason is not None:
        return reason
    if t.size * t.dtype.itemsize < MIN_WEIGHT_BYTES:
        return f"a weight of {t.size * t.dtype.itemsize} bytes (the kernel reads {MIN_WEIGHT_BYTES} or more)"
    rows = math.prod(x.shape[:-1])
    if not ROWS_MIN <= rows <= ROWS_MAX:
        return f"{rows} rows (the kernel runs {ROWS_MIN}..{ROWS_MAX})"
    return _registered()


def kernel_unavailable(x, t) -> str | None:
    """Why the kernel cannot compute x [..., K] @ t [K, N] at all (backend, dtypes, shapes, build), or None.
    Unlike `rows_matmul_supported` there is no row or weight-size range and no off switch: it is what
    `rows_matmul_invariant` runs at every row count and weight size."""
    return _operands_refused(x, t) or _registered()


def _operands_refused(x, t) -> str | None:
    if jax.default_backend() != "cpu":
        return f"the kernel is for XLA's CPU backend, not {jax.default_backend()}"
    if x.dtype != jnp.float32 or t.dtype != jnp.float32:
        return f"float32 only (x {x.dtype}, t {t.dtype})"
    if t.ndim != 2 or x.shape[-1] != t.shape[0]:
        return f"x [..., K] and t [K, N] expected (x {tuple(x.shape)}, t {tuple(t.shape)})"
    return None


def rows_matmul(x, t):
    """x [..., K] @ t [K, N] -> [..., N] in x's dtype: the kernel where supported, else the reference."""
    if rows_matmul_supported(x, t) is not None:
        return rows_matmul_reference(x, t)
    return _kernel(x, t)


def rows_matmul_invariant(x, t):
    """x [..., K] @ t [K, N] -> [..., N] through the kernel at every row count and weight size (the batch-invariant
    mode's product: each row summed over k in increasing order, one FMA at a time, whatever the rows around it).
    Raises ValueError where the kernel cannot run (`kernel_unavailable`): the mode promises bits, not a fallback."""
    reason = kernel_unavailable(x, t)
    if reason is not None:
        raise ValueError(f"batch-invariant product: the rows kernel cannot run: {reason}")
    return _kernel(x, t)


@jax.custom_jvp
def _kernel(x, t):
    lead, n = x.shape[:-1], t.shape[1]
    flat = x.reshape(-1, x.shape[-1])
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((flat.shape[0], n), jnp.float32), vmap_method="sequential")
    return jax.lax.platform_dependent(flat, t, cpu=call, default=rows_matmul_reference).reshape(*lead, n)


@_kernel.defjvp
def _kernel_jvp(primals, tangents):
    (x, t), (dx, dt) = primals, tangents
    return _kernel(x, t), rows_matmul_reference(dx, t) + rows_matmul_reference(x, dt)
