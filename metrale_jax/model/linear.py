"""The model's one dense projection.

Owns: `linear`, the x @ W.T every projection of the model uses (weights stored [out, in], as in
the checkpoints). Invariant: the product is computed in the activation dtype (no upcast).
"""

from __future__ import annotations

import jax.numpy as jnp


def linear(x, w):
    """x [..., in] @ w[out, in].T -> [..., out], in the activation dtype."""
    return jnp.einsum("...i,oi->...o", x, w)
