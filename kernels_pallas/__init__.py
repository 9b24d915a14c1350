"""Pallas kernels on the engine's hot paths, one folder per op.

Each op folder holds `reference.py` (the readable jnp twin, which is also what the `xla`
forward runs), the Pallas kernel, and `api.py` (selects the implementation, explains refusals via
`*_supported(...) -> reason | None`, and carries the interpret switch for CPU).
"""
