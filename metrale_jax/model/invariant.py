"""The batch-invariant mode's switch for the model's products, read while a program is traced.

Owns: `batch_invariant_products` (a context manager: the products traced inside it run the CPU rows kernel at
every row count, `kernels_cpu.rows_matmul.api.rows_matmul_invariant`), `products_invariant` (whether the trace
is inside it), `invariant_product` (x @ t through that kernel) and `fma_contraction_pinned` (whether this
process's XLA CPU code is free of FMA contraction, which the mode also needs: `runtime_env.pin_fma_contraction`).

Invariants:
- Outside the context nothing changes: `linear` dispatches as it always did, so a program traced without the mode
  is the program of before.
- Inside it every projection (`linear`, the per-expert products, the lm_head) sums each row over its input
  features in increasing order, one FMA at a time, whatever the number of rows or where the row sits.

NOTE: a trace-time switch rather than a parameter of `linear`: every projection of the model calls `linear`
with no forward object at hand; the engine enters the context around the trace of a program whose ops object
is batch-invariant (`metrale_jax.engine.programs`), and the program cache keys on that ops object.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import jax
import jax.numpy as jnp

from kernels_cpu.rows_matmul.api import rows_matmul_invariant

_STATE = threading.local()


def products_invariant() -> bool:
    """Whether the current trace is inside `batch_invariant_products(True)`."""
    return getattr(_STATE, "on", False)


@contextlib.contextmanager
def batch_invariant_products(on: bool):
    """Trace the block with every product batch-invariant when `on` (nested contexts restore the outer one)."""
    before = products_invariant()
    _STATE.on = on
    try:
        yield
    finally:
        _STATE.on = before


def invariant_product(x, t):
    """x [..., K] @ t [K, N] -> [..., N] float32 through the rows kernel at any row count (t input-major)."""
    return rows_matmul_invariant(x, t)


@functools.cache
def fma_contraction_pinned() -> bool:
    """Whether XLA contracts `a*b + c` into an FMA in this process (False) or not (True): one tiny program whose
    FMA and unfused results differ (a = b = 1 + 2^-12, c = -1: the FMA keeps the product's 2^-24)."""
    a = jnp.full((16,), 1 + 2**-12, jnp.float32)
    out = jax.jit(lambda a, b, c: a * b + c)(a, a, jnp.full((16,), -1.0, jnp.float32))
    return bool(out[0] == 2**-11)
