"""The CPU rows kernel (`kernels_cpu.rows_matmul`) against its jnp twin: values at 1..ROWS_MAX rows (the tails of
the contraction and of the output included), a row's result independent of the rows run with it, where it
applies and where the reference runs instead, that a CUDA lowering never carries it, its JVP and vmap, and a
missing compiler as a reason rather than an error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_cpu.rows_matmul import api, build
from kernels_cpu.rows_matmul.reference import rows_matmul_reference
from metrale_jax.model.linear import TransposedWeight, linear


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    reason = api._registered()
    if reason is not None and ("no C++ compiler" in reason or "cannot write" in reason):
        pytest.skip(reason)  # the machine's, not the kernel's: a build that fails is a failure
    assert reason is None, reason


@pytest.fixture(autouse=True)
def any_weight(monkeypatch):
    """Small weights run the kernel too (the engine's floor, `MIN_WEIGHT_BYTES`, has a test of its own)."""
    monkeypatch.setattr(api, "MIN_WEIGHT_BYTES", 0)


def _operands(m: int, k: int, n: int, seed: int = 0):
    kx, kt = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (m, k), jnp.float32), jax.random.normal(kt, (k, n), jnp.float32)


@pytest.mark.parametrize("k,n", [(64, 128), (37, 13), (3, 21), (130, 67)])
def test_kernel_computes_the_product_and_each_row_alone(k, n):
    x4, t = _operands(api.ROWS_MAX, k, n, seed=k * n)
    kernel = jax.jit(api._kernel)  # the kernel itself, at one row too (where the engine runs XLA's dot)
    rows = []
    for m in range(1, api.ROWS_MAX + 1):
        assert (api.rows_matmul_supported(x4[:m], t) is None) == (m >= api.ROWS_MIN)
        y = kernel(x4[:m], t)
        exact = np.asarray(x4[:m], np.float64) @ np.asarray(t, np.float64)
        np.testing.assert_allclose(np.asarray(y), exact, rtol=1e-5, atol=1e-5 * np.sqrt(k))
        rows.append(np.asarray(y))
    for y in rows[:-1]:
        np.testing.assert_array_equal(y, rows[-1][: len(y)])


def test_leading_axes_are_rows():
    x, t = _operands(4, 48, 40)
    y = jax.jit(api.rows_matmul)(x.reshape(2, 2, 48), t)
    assert y.shape == (2, 2, 40)
    np.testing.assert_array_equal(np.asarray(y).reshape(4, 40), np.asarray(jax.jit(api.rows_matmul)(x, t)))


def _hlo(fn, *args, platform: str = "cpu") -> str:
    """The program of fn(*args), traced now (a new function each call: jit's trace cache would keep a trace made
    before the switch changed)."""
    return jax.jit(lambda *a: fn(*a)).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def test_linear_runs_the_kernel_only_where_it_applies(monkeypatch):
    x, t = _operands(api.ROWS_MAX + 1, 32, 24)
    w = TransposedWeight(t)
    assert api.TARGET in _hlo(linear, x[:2], w)
    assert api.TARGET not in _hlo(linear, x, w)  # more rows: XLA's dot
    assert api.TARGET not in _hlo(linear, x[:1], w)  # one row: XLA's dot
    assert api.TARGET not in _hlo(linear, x[:2], t.T)  # an [out, in] weight: XLA's dot
    assert api.TARGET not in _hlo(linear, x[:2].astype(jnp.bfloat16), TransposedWeight(t.astype(jnp.bfloat16)))
    assert api.TARGET not in _hlo(linear, x[:2], w, platform="cuda")
    monkeypatch.setenv(api.DISABLE_ENV, "0")
    assert "turned off" in api.rows_matmul_supported(x[:2], t)
    assert api.TARGET not in _hlo(linear, x[:2], w)
    np.testing.assert_array_equal(np.asarray(linear(x[:2], w)), np.asarray(rows_matmul_reference(x[:2], t)))


def test_weights_below_the_floor_stay_on_xlas_dot(monkeypatch):
    monkeypatch.undo()
    floor = api.MIN_WEIGHT_BYTES
    x, t = _operands(2, 512, floor // (4 * 512))
    assert api.rows_matmul_supported(x, t) is None
    assert api.TARGET in _hlo(linear, x, TransposedWeight(t))
    assert "bytes" in api.rows_matmul_supported(x, t[:, :-1])
    assert api.TARGET not in _hlo(linear, x, TransposedWeight(t[:, :-1]))


def test_unsupported_calls_say_why():
    x, t = _operands(api.ROWS_MAX + 1, 16, 8)
    assert f"{api.ROWS_MAX + 1} rows" in api.rows_matmul_supported(x, t)
    assert "1 rows" in api.rows_matmul_supported(x[:1], t)
    assert "float32 only" in api.rows_matmul_supported(x[:1].astype(jnp.bfloat16), t)
    assert "expected" in api.rows_matmul_supported(x[:1], t[:5])


def test_jvp_and_vmap_match_the_reference():
    x, t = _operands(3, 40, 24)
    grads = jax.grad(lambda x, t: (api.rows_matmul(x, t) ** 2).sum(), argnums=(0, 1))(x, t)
    want = jax.grad(lambda x, t: (rows_matmul_reference(x, t) ** 2).sum(), argnums=(0, 1))(x, t)
    for g, r in zip(grads, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)
    xs = jnp.stack([x, 2 * x])
    np.testing.assert_allclose(
        np.asarray(jax.vmap(api.rows_matmul, in_axes=(0, None))(xs, t)),
        np.asarray(rows_matmul_reference(xs, t)),
        rtol=1e-5,
        atol=1e-4,
    )


def test_a_missing_compiler_is_a_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    lib, reason = build.library.__wrapped__()
    assert lib is None and "no C++ compiler" in reason


def test_a_build_into_an_empty_cache_loads_and_is_reused(monkeypatch, tmp_path):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    lib, reason = build.library.__wrapped__()
    assert reason is None and lib is not None and lib.MetraleRowsVectorised() in (0, 1)
    (built,) = tmp_path.glob("rows_matmul-*.so")
    stamp = built.stat().st_mtime_ns
    lib, reason = build.library.__wrapped__()
    assert reason is None and built.stat().st_mtime_ns == stamp and list(tmp_path.iterdir()) == [built]


def test_a_failed_build_is_a_reason_and_leaves_no_file(monkeypatch, tmp_path):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(build, "SOURCE", tmp_path / "broken.cc")
    (tmp_path / "broken.cc").write_text("this is not C++\n")
    lib, reason = build.library.__wrapped__()
    assert lib is None and "build failed" in reason
    assert list(tmp_path.glob("*.so")) == []
