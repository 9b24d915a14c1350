"""Pieces every Pallas kernel of this package shares: the interpret switch, the backend names the
`*_supported` checks speak, the Triton shape rules, and the one reduction whose form differs
between the CPU interpreter and Triton.

Owns: what "interpret" means here (the Pallas interpreter; the default whenever the default
backend is not a GPU) and which GPU shape rules a kernel must satisfy before it is lowered.

Invariants:
- A kernel body is the same code on both backends, except for `matvec`'s form, which `matvec_form`
  picks from the interpret switch alone.
- `BACKENDS` are the only backend names `*_supported` accepts: "interpret" (the Pallas interpreter,
  any platform) and "gpu" (compiled through Triton, jax 0.11/0.12's only GPU `pallas_call` path).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

BACKENDS = ("interpret", "gpu")
MatvecForm = Literal["dot", "reduce"]


def default_interpret() -> bool:
    """True unless JAX's default backend is a GPU (compiled Pallas exists only there)."""
    return jax.default_backend() != "gpu"


def backend_of(interpret: bool) -> str:
    return "interpret" if interpret else "gpu"


def matvec_form(interpret: bool) -> MatvecForm:
    """The matvec the kernel bodies use: "dot" under the interpreter, "reduce" for Triton.

    NOTE: Triton lowers only 2-D `dot_general`s, so a matvec must be multiply + sum there. On CPU the
    references' batched matvec einsums run as Eigen dots (sequential fused multiply-adds over the
    contracted axis) while a multiply + sum runs as an XLA reduction in another order, so the
    interpreter uses the dot to stay byte-equal to the reference. Tests run both forms on CPU.
    """
    return "dot" if interpret else "reduce"


def matvec(m, x, form: MatvecForm):
    """sum_j m[j, :] * x[j]: m [n, c], x [n] -> [c] (the references' `einsum("...jc,...j->...c")`)."""
    if form == "dot":
        return jnp.einsum("jc,j->c", m, x)
    return jnp.sum(m * x[:, None], axis=0)


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def triton_dims_reason(**dims: int) -> str | None:
    """Why Triton cannot take these tile/dot dimensions (each must be a power of two >= 16), or None."""
    bad = [f"{name}={n}" for name, n in dims.items() if not (is_pow2(n) and n >= 16)]
    if bad:
        return f"Triton needs power-of-two tile and dot dimensions >= 16; got {', '.join(bad)}"
    return None


def backend_reason(backend: str) -> str | None:
    if backend not in BACKENDS:
        return f"no Pallas kernel for backend {backend!r} (kernels exist for {', '.join(BACKENDS)})"
    return None
