"""Pallas kernels on the engine's hot paths, one folder per op (`gdn`, `paged_attention`), and the
ops objects the model's trunk calls them through.

Each op folder holds `reference.py` (the readable jnp twin, which is also what the `xla` forward
runs), the Pallas kernel and its tiling (`pallas_gpu.py`, Triton-lowerable, interpreted off GPU),
and `api.py` (selects the implementation, explains refusals via `*_supported(...) -> reason | None`,
carries the interpret switch, and declares the kernel's contract against its reference).

Shared: `common.py` (the interpret switch, backend and implementation names, Triton shape rules,
the bounded contract's allowance), `reductions.py` (the program-independent reductions the kernels,
their references and the model use), `ops.py` (the `Ops` protocol, `ReferenceOps` for the `xla`
forward and `PallasOps` for the `pallas` one), `testing.py` (inputs, float64 oracles and the
contract check for the tests and `benchmarks/gpu_check.py`). README.md describes the verification
ladder and how to add an op.

Layering: nothing here imports `metrale_jax`; the model imports from here.
"""

from kernels_pallas.common import KernelRefused, default_interpret
from kernels_pallas.ops import Forward, Ops, PallasOps, ReferenceOps
from kernels_pallas.reductions import first_argmax, ordered_sum, pairwise_sum

__all__ = [
    "Forward",
    "KernelRefused",
    "Ops",
    "PallasOps",
    "ReferenceOps",
    "default_interpret",
    "first_argmax",
    "ordered_sum",
    "pairwise_sum",
]
