"""Builds and loads the rows kernel's shared library, once per process.

Owns: `library()` (the loaded library, or the one-line reason it is not available) and where the build is kept.

Invariants:
- The library is compiled for this machine (`-march=native`) from `rows_matmul.cc` against the XLA FFI headers of
  the jaxlib this process imports, and kept under a name that hashes all three (source, headers' jaxlib version,
  the CPU's model and flags), so a cache shared between machines or jaxlib versions never loads a stale build.
- A build is written to a temporary file and renamed into place: concurrent processes never load a partial file.
- No compiler, a failed build or a library that does not load give a reason, never an exception: the caller runs
  the reference instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

SOURCE = Path(__file__).with_name("rows_matmul.cc")
#: Where builds are kept (default: $XDG_CACHE_HOME/metrale-jax/kernels, else ~/.cache/metrale-jax/kernels).
CACHE_ENV = "METRALE_JAX_KERNEL_CACHE"


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "metrale-jax" / "kernels"


def _cpu_identity() -> str:
    """The CPU's model name and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return "\n".join(sorted(set(keep))) or platform.machine()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


@functools.cache
def library() -> tuple[ctypes.CDLL | None, str | None]:
    """(the loaded library, None), or (None, why not)."""
    cxx = _compiler()
    if cxx is None:
        return None, f"no C++ compiler ({os.environ.get('CXX', 'c++')!r} not found; set CXX)"
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + jaxlib.__version__.encode() + _cpu_identity().encode() + cxx.encode()).hexdigest()
    out = cache_dir() / f"rows_matmul-{key[:20]}.so"
    if not out.exists():
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
            os.close(fd)
        except OSError as e:
            return None, f"cannot write the kernel build under {out.parent}: {e.strerror or e}"
        # NOTE: the C++ runtime is linked in and every symbol but the handler's hidden, so the library brings no
        # second copy of libstdc++'s symbols into a process whose jaxlib has its own.
        cmd = [cxx, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden"]
        cmd += ["-fvisibility-inlines-hidden", "-static-libstdc++", "-static-libgcc", "-Wl,--exclude-libs,ALL"]
        cmd += ["-isystem", jax.ffi.include_dir(), "-o", tmp, str(SOURCE)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
                return None, f"the kernel build failed ({' '.join(cmd[:2])} ...): {last}"
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        return ctypes.CDLL(str(out)), None
    except OSError as e:
        return None, f"the kernel build {out} does not load: {e}"
