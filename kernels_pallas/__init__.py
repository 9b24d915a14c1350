"""Pallas kernels on the engine's hot paths, one folder per op.

Each op folder holds `reference.py` (the readable jnp twin, which is also what the `xla`
forward runs), the Pallas kernel (`pallas_gpu.py`, Triton-lowerable, interpreted on CPU), and
`api.py` (selects the implementation, explains refusals via `*_supported(...) -> reason | None`,
carries the interpret switch for CPU, and declares the kernel's contract against its reference).

Shared: `common.py` (interpret switch, Triton shape rules, the bounded contract's allowance),
`ops.py` (`PallasOps`, the `pallas` forward's ops object), `testing.py` (inputs and float64
oracles for the tests and `benchmarks/gpu_check.py`).
"""
