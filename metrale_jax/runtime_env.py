"""The process's thread and platform environment: the one place that sets it.

Owns: `prepare` (the BLAS/OpenMP pool sizes, the JAX platform and JAX's persistent compilation
cache, as environment defaults), `compilation_cache_dir` and `pin_to_one_core` (this process on
its first allowed CPU, the last one published for a sibling process). Every entry point calls
these before it imports jax: the `metrale-jax` command (`cli/main.py`), `python -m benchmarks`
(`benchmarks/cli.py`) and the test suite.

Invariants:
- Only defaults are set (`os.environ.setdefault`): a variable the user exported wins.
- Imports nothing but the standard library, so calling it loads no jax.
- Effective only before jax starts its backend: XLA sizes its thread pool, and OpenBLAS its
  pool, once, when they start.

The persistent compilation cache: XLA's compiled programs are kept on disk and loaded by a later
process instead of compiled again (JAX's own cache: `JAX_COMPILATION_CACHE_DIR`; its key covers
the program, the compile options, the backend and the jax/jaxlib versions). Every program is kept,
however short its compile or small its executable (the thresholds at 0), so CPU programs are
too. `METRALE_JAX_COMPILATION_CACHE` names the directory (default
`$XDG_CACHE_HOME/metrale-jax/jax`, else `~/.cache/metrale-jax/jax`), or switches it off
(`off`, `0`, `no`, `false`); the test suite switches it off (`tests/conftest.py`).

NOTE: the xla forward's GDN chunk calls LAPACK's triangular solve, which runs on OpenBLAS's
thread pool; on a loaded small machine a pool of one thread per core stalls when the load
exceeds the cores. One thread is what XLA's own CPU ops already use per op, hence
`OPENBLAS_NUM_THREADS=1` by default everywhere.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

#: The BLAS / OpenMP pools jaxlib's LAPACK calls and torch use.
BLAS_POOLS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
#: The CPU `pin_to_one_core` leaves to a sibling process (the benchmark's HF driver reads it).
SIBLING_CPU = "METRALE_BENCH_HF_CPU"
#: The persistent compilation cache's directory, or one of `CACHE_OFF` to switch it off.
COMPILATION_CACHE_ENV = "METRALE_JAX_COMPILATION_CACHE"
CACHE_OFF = ("off", "0", "no", "false")


#: The XLA flag that pins FMA contraction on XLA CPU for the batch-invariant mode (`pin_fma_contraction`).
FMA_PIN_FLAG = "--xla_cpu_max_isa=AVX"


def pin_fma_contraction() -> None:
    """Add `FMA_PIN_FLAG` to `XLA_FLAGS` (before jax starts its backend): XLA CPU's generated code then has no FMA.

    NOTE: XLA CPU lets LLVM contract `a*b + c` into an FMA wherever both ops land in one fusion, and fusion
    boundaries follow the program's shapes: a verify row and a decode of the same token, or a prompt in chunks
    and in one pass, then round differently (measured on tiny: everything else made invariant, verify row 3
    and the chunked prefill still differed by ~1e-6; with this flag they are bit-identical). There is no
    per-program option: `compiler_options={"xla_cpu_max_isa": ...}` did not change the code, the process flag
    does. The rows kernel is built apart and keeps its own (fixed) FMAs."""
    flags = os.environ.get("XLA_FLAGS", "")
    if FMA_PIN_FLAG not in flags.split():
        os.environ["XLA_FLAGS"] = f"{flags} {FMA_PIN_FLAG}".strip()


def compilation_cache_dir() -> Path | None:
    """The persistent compilation cache's directory: `$METRALE_JAX_COMPILATION_CACHE`, else
    `$XDG_CACHE_HOME/metrale-jax/jax`, else `~/.cache/metrale-jax/jax`; None when the variable
    switches it off (one of `CACHE_OFF`, any case)."""
    named = os.environ.get(COMPILATION_CACHE_ENV, "")
    if named.strip().lower() in CACHE_OFF:
        return None
    if named:
        return Path(named)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "metrale-jax" / "jax"


def prepare(
    *,
    threads: int = 1,
    pools: Sequence[str] = ("OPENBLAS_NUM_THREADS",),
    cpu_only: bool = False,
    compilation_cache: bool = True,
) -> None:
    """Default each of `pools` to `threads` threads (`threads` 0: leave every pool at its
    library default), with `cpu_only` JAX to its CPU platform, and with `compilation_cache` JAX's
    persistent compilation cache to `compilation_cache_dir()` (unless switched off there) with
    every program kept."""
    cache = compilation_cache_dir() if compilation_cache else None
    if cache is not None:
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache))
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    if threads >= 1:
        for var in pools:
            os.environ.setdefault(var, str(threads))
    if cpu_only:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


def allowed_cores() -> int:
    """The CPU cores this process may run on (its affinity; the machine's count where the OS has none)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pin_to_one_core() -> None:
    """Pin this process to its first allowed CPU and publish its last one in `SIBLING_CPU`, so a
    child process can take a core of its own. A no-op where the OS has no CPU affinity.

    NOTE: XLA CPU runs a program's thunks on a pool of one thread per allowed core, so the
    affinity (not a thread flag) is what makes it single-core. Not
    `--xla_cpu_multi_thread_eigen=false`: with it XLA CPU copies every weight matrix into a
    transposed layout at every step."""
    if not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[0]})
    os.environ[SIBLING_CPU] = str(cpus[-1])
