"""Kernels for XLA's CPU backend, where Pallas runs only in its interpreter: C++ behind XLA's FFI, each with a jnp
reference twin and an `*_supported(...) -> reason | None` check, built on first use with the system C++ compiler."""
