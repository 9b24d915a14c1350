"""The model's dense projections.

Owns: `linear`, the x @ W.T every projection of the model uses (weights stored [out, in], as in
the checkpoints), and `linear_parts`, one product with a row-stacked weight split into its parts.
Invariant: the product is computed in the activation dtype (no upcast).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np


def linear(x, w):
    """x [..., in] @ w[out, in].T -> [..., out], in the activation dtype."""
    return jnp.einsum("...i,oi->...o", x, w)


def linear_parts(x, w, rows: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """The projections x @ w_i.T of a row-stacked w = [w_0; w_1; ...] ([sum(rows), in]; w_i has
    rows[i] rows) as one product: a tuple of [..., rows[i]].

    NOTE: XLA does not merge products that share an input, and a small step pays a launch for
    each; the parameter tree stores such projections stacked (see
    `metrale_jax.params`).
    """
    chex.assert_shape(w, (sum(rows), x.shape[-1]))
    return tuple(jnp.split(linear(x, w), np.cumsum(rows)[:-1].tolist(), axis=-1))
