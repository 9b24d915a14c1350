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
if _n == 1 and not _gpu:
    # One XLA CPU thread, no Eigen pool: the HF side gets torch.set_num_threads(1) to match.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
                               " intra_op_parallelism_threads=1").strip()
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
