"""`python -m benchmarks …`: see `benchmarks.cli`. The thread setting is applied here, before jax
is imported (XLA reads its flags once, at backend start)."""

import os
import sys


def _threads(argv) -> int:
    for i, a in enumerate(argv):
        if a == "--threads" and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith("--threads="):
            return int(a.split("=", 1)[1])
    return 1


_gpu = "--gpu" in sys.argv[1:] and "--dry-run" not in sys.argv[1:]
_n = _threads(sys.argv[1:])
if _n == 1 and not _gpu and hasattr(os, "sched_setaffinity"):
    # One core per side. XLA CPU runs a program's thunks on a pool of one thread per core
    # (concurrently where they are independent), so the affinity, not a thread flag, is what
    # makes it single-core; on this 2-vCPU machine it also removes most of the spread (tiny
    # verify step: 1.6 ms pinned, 1.8-2.5 ms free). The HF driver gets the other core
    # (METRALE_BENCH_HF_CPU, applied by `hf_driver.py`): the two processes never share a core.
    # NOTE: not --xla_cpu_multi_thread_eigen=false: with it XLA CPU copies every weight matrix
    # into a transposed layout at every step (48 extra copies in a tiny verify step).
    _cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {_cpus[0]})
    os.environ["METRALE_BENCH_HF_CPU"] = str(_cpus[-1])
if _n >= 1 and not _gpu:
    # The BLAS/LAPACK pools too (both sides inherit them): jaxlib's CPU LAPACK calls (the XLA GDN
    # chunk reference's triangular solve) run on scipy's OpenBLAS, whose default pool of one
    # thread per core stalled 100-1000x under a load above the core count (measured here).
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(_n))
if not _gpu:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks.cli import main  # noqa: E402

sys.exit(main())
