"""`kernels_pallas.reductions`: the rewritten reductions keep the plain ones' semantics.

Claims: `first_argmax` equals `jnp.argmax` (int32) on random rows, on ties (the first index wins),
on rows with NaN (the first NaN wins), on all -inf rows and on bfloat16; `ordered_sum` adds left
to right in the input's dtype (the same bytes as a Python left fold).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.reductions import first_argmax, ordered_sum


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_first_argmax_is_argmax(dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 5, 37)).astype(np.float32)
    x[0, 0, [3, 9, 30]] = 50.0  # a tie: the first index wins
    x[1, 1, [4, 20]] = np.nan  # NaN: the first NaN wins, whatever the maximum
    x[1, 2, 36] = np.nan
    x[2, 3] = -np.inf  # nothing but -inf: index 0
    x[3, 4, :] = 1.0  # all equal
    x = jnp.asarray(x, dtype)
    got = jax.jit(first_argmax)(x)
    assert got.dtype == jnp.int32 and got.shape == x.shape[:-1]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(x, axis=-1)))
    assert int(got[0, 0]) == 3 and int(got[1, 1]) == 4 and int(got[1, 2]) == 36 and int(got[2, 3]) == 0


def test_ordered_sum_is_a_left_fold():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((3, 4, 7)) * 10.0 ** rng.integers(-6, 6, (3, 4, 7)), jnp.float32)
    want = x[:, 0]
    for i in range(1, 4):
        want = want + x[:, i]
    got = jax.jit(ordered_sum, static_argnums=1)(x, 1)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))


def _compose(f, g):
    """x -> f(g(x))."""
    return lambda x: f(g(x))


def test_norms_give_a_row_the_same_bytes_in_any_batch_and_fusion():
    """`rms_norm` / `gated_rms_norm` of a row do not depend on the array around it or on the
    product it is sliced from (their sums are `pairwise_sum`s; `jnp.mean` differed)."""
    from metrale_jax.model.linear import linear_parts
    from metrale_jax.model.norms import gated_rms_norm, rms_norm

    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((96, 64)), jnp.float32)
    w = jnp.asarray(0.1 * rng.standard_normal(64), jnp.float32)
    proj = jnp.asarray(rng.standard_normal((64 + 40, 64)) / 8, jnp.float32)
    z = jnp.asarray(rng.standard_normal((96, 64)), jnp.float32)
    norms = {"rms": lambda h: rms_norm(h, w, 1e-6), "gated": lambda h: gated_rms_norm(h, z[: h.shape[0]], w, 1e-6)}
    first_part = lambda h: linear_parts(h, proj, (64, 40))[0]
    for name, norm in norms.items():
        whole = np.asarray(jax.jit(norm)(x))
        for rows in (1, 3, 8):
            np.testing.assert_array_equal(np.asarray(jax.jit(norm)(x[:rows])), whole[:rows], err_msg=f"{name} {rows}")
        sliced = jax.jit(_compose(norm, first_part))(x)
        alone = jax.jit(norm)(jax.jit(first_part)(x))
        np.testing.assert_array_equal(np.asarray(sliced), np.asarray(alone), err_msg=name)
