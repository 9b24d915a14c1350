"""Every Pallas kernel against its reference on a GPU, at real shapes, timed against the bandwidth
floor; `--dry-run` runs the same shape set scaled down, under the interpreter, on any machine.

Owns: the device check's case list, its pass rule and its table. Run it through
`benchmarks/gpu_check.sh` (one call, a few minutes on an H200).

Per case:
- correctness: the kernel's and the reference's outputs are compared with the float64 numpy
  oracle on a slice (sequence 0; for GDN its first two key heads' value heads, for attention its
  last 32 rows); pass = no NaN anywhere and kernel error <= `common.contract_bound(reference
  error)`. (Bit-identity is a CPU-interpreter contract; on a GPU every kernel is bounded.)
- timing: median of `--iters` runs of the jitted kernel and of the jitted reference, after a warm-up.
- floor: the bytes the op must move (inputs read once, outputs written once; attention reads only
  the K/V of live keys) / the HBM bandwidth measured in the same run by a large device copy.
  The GDN chunk kernel is compute-bound, so it sits far above its floor by nature.

The table is printed last; the exit status is 1 when any case fails or errors.

NOTE: argparse, not Click: the check runs on a bare jax install (`gpu_check.sh`), with nothing
from the repo but `kernels_pallas/` and `metrale_jax/text_table.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from kernels_pallas import common, testing
from kernels_pallas.gdn import api as gdn_api
from kernels_pallas.paged_attention import api as attn_api
from metrale_jax.text_table import text_table


@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel call. GDN: b, t, hk, h, d (= dk = dv). Attention: b, t, h, kvh, d, bs, ctx
    (keys per sequence the table spans), dtype."""

    name: str
    kernel: str  # gdn_rows | gdn_chunk | attention
    real: dict
    tiny: dict


GDN_DIMS = ("b", "t", "hk", "h", "d")
ATTENTION_DIMS = ("b", "t", "h", "kvh", "d")


def _case(name: str, kernel: str, real: tuple[int, ...], tiny: tuple[int, ...]) -> Case:
    """A Case from its dims in `GDN_DIMS` or `ATTENTION_DIMS` order. Attention tables span 4096 keys
    in 16-key blocks at real width, 64 keys in 4-key blocks tiny."""
    if kernel == "attention":
        return Case(
            name,
            kernel,
            dict(zip(ATTENTION_DIMS, real), bs=16, ctx=4096),
            dict(zip(ATTENTION_DIMS, tiny), bs=4, ctx=64),
        )
    return Case(name, kernel, dict(zip(GDN_DIMS, real)), dict(zip(GDN_DIMS, tiny)))


CASES = (  # name, kernel, real dims, tiny dims
    _case("decode 35B", "gdn_rows", (64, 1, 16, 32, 128), (2, 1, 2, 4, 16)),
    _case("verify 35B", "gdn_rows", (32, 4, 16, 32, 128), (2, 4, 2, 4, 16)),
    _case("verify 397B", "gdn_rows", (32, 4, 16, 64, 128), (2, 4, 1, 4, 16)),
    _case("prefill 35B", "gdn_chunk", (1, 4096, 16, 32, 128), (1, 130, 2, 4, 16)),
    _case("prefill 397B ragged", "gdn_chunk", (2, 1000, 16, 64, 128), (2, 100, 1, 4, 16)),
    _case("decode 16:2 d256", "attention", (32, 1, 16, 2, 256), (2, 1, 4, 2, 16)),
    _case("verify 16:2 d256", "attention", (32, 4, 16, 2, 256), (2, 4, 4, 2, 16)),
    _case("verify 8:1 d128", "attention", (32, 4, 8, 1, 128), (2, 4, 8, 1, 16)),
    _case("prefill chunk 16:2", "attention", (2, 512, 16, 2, 256), (2, 20, 4, 2, 16)),
)


@dataclasses.dataclass
class Row:
    case: str
    kernel: str
    ms: float = float("nan")
    ref_ms: float = float("nan")
    floor_ms: float = float("nan")
    err: float = float("nan")
    ref_err: float = float("nan")
    ok: bool = False
    note: str = ""


def abstract_args(case: Case, shape: dict) -> tuple:
    """The kernel's arguments as ShapeDtypeStructs (what `*_supported` and export need)."""
    if case.kernel == "attention":
        b, t, h, kvh, d, bs, mb, nb = _attention_dims(shape)
        return testing.attention_abstract_args(b, t, h, kvh, d, bs=bs, nb=nb, mb=mb)
    b, t, hk, h, d = (shape[k] for k in GDN_DIMS)
    return testing.gdn_abstract_args(b, t, hk, h, d, d)


def supported(case: Case, shape: dict, backend: str) -> str | None:
    checks: dict[str, Callable[..., str | None]] = {
        "gdn_rows": gdn_api.gdn_rows_supported,
        "gdn_chunk": gdn_api.gdn_chunk_supported,
        "attention": attn_api.paged_attention_supported,
    }
    return checks[case.kernel](*abstract_args(case, shape), backend=backend)


def _attention_dims(shape: dict):
    """(b, t, h, kvh, d, bs, mb, nb): the table spans ctx keys; the pool holds every table + 1."""
    b, t, h, kvh, d, bs, ctx = (shape[k] for k in (*ATTENTION_DIMS, "bs", "ctx"))
    return b, t, h, kvh, d, bs, ctx // bs, b * (ctx // bs) + 1


def measure_bandwidth(nbytes: int, iters: int) -> float:
    """HBM bytes/s of a device copy of a float32 buffer of `nbytes` (read + write)."""
    x = jnp.zeros(nbytes // 4, jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)
    return 2 * nbytes / _median_seconds(copy, (x,), iters)


def _median_seconds(fn, args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gdn(case: Case, shape: dict, rng, interpret: bool):
    """(kernel fn, reference fn, args, bytes moved, check(kernel_out, ref_out) -> (err, ref_err))."""
    b, t, hk, h, d = (shape[k] for k in GDN_DIMS)
    args = testing.gdn_inputs(rng, b, t, hk, h, d, d, initial_state=True)
    if case.name.endswith("ragged"):
        args = testing.gdn_pad_rows(args, [t, t // 3])
    chunk = case.kernel == "gdn_chunk"
    api_fn = gdn_api.chunk_gated_delta_rule if chunk else gdn_api.recurrent_gated_delta_rule
    kernel = jax.jit(lambda *a: api_fn(*a, interpret=interpret))
    ref = jax.jit(lambda *a: api_fn(*a, implementation="reference"))
    state = b * h * d * d * 4
    moved = 4 * (2 * b * t * hk * d + 2 * b * t * h * d + 2 * b * t * h) + state + (state if chunk else t * state)
    # Oracle slice: sequence 0, key heads 0..1 and the value heads that read them.
    nv = 2 * (h // hk)
    q, k, v, g, beta, h0 = args
    sub = (q[:1, :, :2], k[:1, :, :2], v[:1, :, :nv], g[:1, :, :nv], beta[:1, :, :nv], h0[:1, :nv])

    def sliced(o, s):
        return np.asarray(o[:1, :, :nv]), np.asarray(s[:1, :nv] if chunk else s[:1, :, :nv])

    def check(out, ref_out):
        o64, states64 = testing.gdn_oracle(*sub)
        s64 = states64[:, -1] if chunk else states64
        return [max(testing.rel_err(o, o64), testing.rel_err(s, s64)) for o, s in (sliced(*out), sliced(*ref_out))]

    return kernel, ref, tuple(jnp.asarray(x) for x in args), moved, check


def _attention(case: Case, shape: dict, rng, interpret: bool):
    b, t, h, kvh, d, bs, mb, nb = _attention_dims(shape)
    ctx = mb * bs
    starts = [int(s) for s in rng.integers(ctx // 2, ctx - t + 1, b)]  # ragged context lengths
    q, kc, vc, tables, positions = testing.attention_inputs(
        rng, ml_dtypes.bfloat16, b=b, t=t, h=h, kvh=kvh, d=d, bs=bs, nb=nb, mb=mb, starts=starts
    )
    scale = d**-0.5
    kernel = jax.jit(functools.partial(attn_api.paged_attention, scale=scale, interpret=interpret))
    ref = jax.jit(functools.partial(attn_api.paged_attention, scale=scale, implementation="reference"))
    live_keys = int((positions.max(axis=1) + 1).sum())
    moved = 2 * (2 * q.size) + 2 * live_keys * kvh * d * 2 + tables.size * 4 + positions.size * 4
    rows = slice(max(0, t - 32), t)

    def check(out, ref_out):
        o64 = testing.attention_oracle(q[:1, rows], kc, vc, tables[:1], positions[:1, rows], scale)
        return [testing.rel_err(np.asarray(x[:1, rows]).astype(np.float32), o64) for x in (out, ref_out)]

    return kernel, ref, tuple(jnp.asarray(x) for x in (q, kc, vc, tables, positions)), moved, check


def run_case(case: Case, *, dry_run: bool, iters: int, bandwidth: float, seed: int) -> Row:
    row = Row(case.name, case.kernel)
    shape = case.tiny if dry_run else case.real
    rng = np.random.default_rng(seed)
    make = _attention if case.kernel == "attention" else _gdn
    if reason := supported(case, shape, common.backend_of(dry_run)):
        row.note = f"refused: {reason}"
        return row
    try:
        kernel, ref, args, moved, check = make(case, shape, rng, interpret=dry_run)
        out, ref_out = kernel(*args), ref(*args)
        finite = all(not np.isnan(np.asarray(x, np.float32)).any() for x in jax.tree.leaves(out))
        row.err, row.ref_err = check(out, ref_out)
        dtype = jnp.float32 if case.kernel != "attention" else jnp.bfloat16
        row.ok = finite and row.err <= common.contract_bound(row.ref_err, dtype)
        row.note = "" if finite else "NaN in kernel output"
        row.ms = 1e3 * _median_seconds(kernel, args, iters)
        row.ref_ms = 1e3 * _median_seconds(ref, args, iters)
        row.floor_ms = 1e3 * moved / bandwidth
    except Exception as e:  # one broken case must not hide the others' results
        traceback.print_exc()
        row.note = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
    return row


def format_table(rows: list[Row], bandwidth: float, header: str) -> str:
    cells = [
        (
            r.case,
            r.kernel,
            f"{r.ms:.3f}",
            f"{r.ref_ms:.3f}",
            f"{r.floor_ms:.3f}",
            f"{r.ms / r.floor_ms:.1f}",
            f"{r.err:.1e}",
            f"{r.ref_err:.1e}",
            ("ok" if r.ok else "FAIL") + (f" {r.note}" if r.note else ""),
        )
        for r in rows
    ]
    headers = ("case", "kernel", "ms", "ref ms", "floor ms", "x floor", "err", "ref err", "result")
    table = text_table(headers, cells, right=range(2, 8))
    return "\n".join([header, f"HBM copy bandwidth {bandwidth / 1e9:.0f} GB/s (floor = bytes moved / that)", *table])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="interpreter, tiny shapes (any machine)")
    parser.add_argument("--iters", type=int, default=None, help="timed runs per case (default 20, dry run 2)")
    parser.add_argument("--only", default=None, help="run only cases whose name or kernel contains this")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    iters = args.iters or (2 if args.dry_run else 20)
    backend = jax.default_backend()
    if not args.dry_run and backend != "gpu":
        parser.error(f"no GPU (default backend {backend!r}); use --dry-run to check the script itself")
    cases = [c for c in CASES if args.only is None or args.only in c.name or args.only in c.kernel]
    if not cases:
        parser.error(f"no case matches --only {args.only!r}")
    bandwidth = measure_bandwidth(2**20 if args.dry_run else 2**31, iters)
    rows = [
        run_case(c, dry_run=args.dry_run, iters=iters, bandwidth=bandwidth, seed=args.seed + i)
        for i, c in enumerate(cases)
    ]
    device = jax.devices()[0]
    dry = ", DRY RUN (interpreter, tiny shapes)" if args.dry_run else ""
    header = f"gpu_check: jax {jax.__version__}, {device.device_kind} ({backend}){dry}"
    print(format_table(rows, bandwidth, header))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
