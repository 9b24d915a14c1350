"""Pieces every Pallas kernel of this package shares: the interpret switch, the backend and
implementation names the `api` modules speak, the Triton shape rules, the one matvec whose form
differs between the CPU interpreter and Triton, and the "bounded" contract's allowance.

Owns: what "interpret" means here (the Pallas interpreter; the default whenever the default
backend is not a GPU), the mode aliases (`Backend`, `Implementation`, `MatvecForm`), which GPU
shape rules a kernel must satisfy before it is lowered, `contract_bound`, `KernelRefused`, and
`dispatch` (the reference / refusal / kernel choice every `api` entry point makes).

Invariants:
- A kernel body is the same code on both backends, except for the forms picked from the interpret
  switch alone: `matvec`'s (GDN) and the attention body's reduction and dot forms (see
  `paged_attention/pallas_gpu.py`); under the interpreter every kernel is byte-equal to its
  reference, compiled through Triton it is bounded.
- `BACKENDS` are the only backend names `*_supported` accepts: "interpret" (the Pallas interpreter,
  any platform) and "gpu" (compiled through Triton, jax 0.11/0.12's only GPU `pallas_call` path).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp

from kernels_pallas.invariant import invariant_einsum

Backend = Literal["interpret", "gpu"]
#: The custom-call target of a Pallas kernel lowered for GPU (Triton): `jax.export` checks its targets.
TRITON_CALL = "__gpu$xla.gpu.triton"
BACKENDS: tuple[Backend, ...] = ("interpret", "gpu")
Implementation = Literal["pallas", "reference"]  # an `api` entry point's choice: the kernel or its reference
IMPLEMENTATIONS: tuple[Implementation, ...] = ("pallas", "reference")
MatvecForm = Literal["dot", "reduce", "invariant"]  # see `matvec_form`


def default_interpret() -> bool:
    """True unless JAX's default backend is a GPU (compiled Pallas exists only there)."""
    return jax.default_backend() != "gpu"


def check_implementation(implementation: str) -> None:
    """Raise ValueError unless `implementation` is one of `IMPLEMENTATIONS`."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}; got {implementation!r}")


def backend_of(interpret: bool) -> Backend:
    """The backend name a kernel run with this interpret switch lowers for."""
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
    """sum_j m[j, :] * x[j]: m [n, c], x [n] -> [c] (the references' `einsum("...jc,...j->...c")`); "invariant"
    (the batch-invariant configuration, interpreter only): `invariant_einsum`, the batch-invariant reference's."""
    if form == "invariant":
        return invariant_einsum("jc,j->c", m, x)
    if form == "dot":
        return jnp.einsum("jc,j->c", m, x)
    return jnp.sum(m * x[:, None], axis=0)


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def triton_dims_reason(*, minimum: int, **dims: int) -> str | None:
    """Why Triton cannot take these array dimensions, or None. Every array a Triton kernel loads,
    stores or builds must have power-of-two dimensions, and a dot's dimensions must be >= 16."""
    bad = [f"{name}={n}" for name, n in dims.items() if not (is_pow2(n) and n >= minimum)]
    if bad:
        return f"Triton needs power-of-two dimensions >= {minimum} here; got {', '.join(bad)}"
    return None


def int32_offsets_reason(**sizes: int) -> str | None:
    """Triton computes element offsets in int32: every array it addresses must have < 2**31 elements."""
    bad = [f"{name} has {n} elements" for name, n in sizes.items() if n >= 2**31]
    if bad:
        return f"Triton offsets are int32: {', '.join(bad)} (>= 2**31)"
    return None


BOUND_FACTOR = 2.0


def contract_bound(reference_err: float, dtype) -> float:
    """The "bounded" contract's allowance for a kernel's error against the float64 oracle: twice
    the reference's own error against it, plus one unit roundoff of the output dtype. Errors are
    `kernels_pallas.testing.rel_err` (max abs error over max abs oracle value)."""
    return BOUND_FACTOR * reference_err + float(jnp.finfo(dtype).eps) / 2


class KernelRefused(ValueError):
    """A Pallas kernel was asked for on shapes or a backend its `*_supported` check refuses."""


def dispatch[TilingT, OutT](
    kernel_name: str,
    implementation: str,
    interpret: bool | None,
    tiling: TilingT | None,
    *,
    reference: Callable[[], OutT],
    default_tiling: Callable[[bool], TilingT],
    supported: Callable[[Backend, TilingT], str | None],
    kernel: Callable[[TilingT, bool], OutT],
) -> OutT:
    """The body every `api` entry point shares. Checks `implementation` (ValueError); "reference"
    returns `reference()`. "pallas" resolves `interpret` (None = `default_interpret()`) and `tiling`
    (None = `default_tiling(interpret)`), raises `KernelRefused("<kernel_name>: <reason>")` when
    `supported(backend_of(interpret), tiling)` gives a reason, and returns `kernel(tiling, interpret)`."""
    check_implementation(implementation)
    if implementation == "reference":
        return reference()
    interpret = default_interpret() if interpret is None else interpret
    tiling = tiling or default_tiling(interpret)
    if reason := supported(backend_of(interpret), tiling):
        raise KernelRefused(f"{kernel_name}: {reason}")
    return kernel(tiling, interpret)


def backend_reason(backend: str) -> str | None:
    if backend not in BACKENDS:
        return f"no Pallas kernel for backend {backend!r} (kernels exist for {', '.join(BACKENDS)})"
    return None
