"""The rows kernel's jnp twin: x [..., K] @ t [K, N] in the activation dtype (what XLA's own dot computes)."""

from __future__ import annotations

import jax.numpy as jnp


def rows_matmul_reference(x, t):
    """x [..., K] @ t [K, N] -> [..., N]."""
    return jnp.einsum("...i,io->...o", x, t)
