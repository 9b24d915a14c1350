"""Shared test fixtures: the embedded tiny model and settings builders.

Engines are module-scoped where tests can share compiled programs (compilation dominates the
suite's time on a 2-core CPU)."""

from __future__ import annotations

import gc
import os

import pytest
import tiers

from metrale_jax import runtime_env

# no persistent compilation cache: the suite writes nothing under the user's home (a test that
# exercises the cache names a temporary directory of its own)
os.environ[runtime_env.COMPILATION_CACHE_ENV] = "off"
runtime_env.prepare(cpu_only=True)  # before anything imports jax

from metrale_jax.engine.settings import resolve_settings  # noqa: E402
from metrale_jax.presets import resolve_checkpoint  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def settings(**flags):
    """EngineSettings from serve flags given as Python values (names as in EngineSettings).
    KV defaults to f32 here (the serve default, fp8, is lossy next to a float32 model)."""
    flags.setdefault("kv_cache_dtype", "f32")
    raw = {k: (str(v) if k == "max_batch_size" else v) for k, v in flags.items()}
    return resolve_settings(raw, None, auto_slots=int(flags.get("max_batch_size", 8)))


def pytest_collection_modifyitems(config, items):
    """The tiers' markers (`slow`, `subprocess`, `sharded`) from the table in tests/tiers.py."""
    tiers.mark(config, items)


@pytest.fixture(scope="module", autouse=True)
def _free_executables():
    """Drop every compiled program when a test module ends.

    NOTE: XLA CPU maps each loaded executable's JIT code separately, and jax's caches keep the
    executables of module-level jitted functions alive for the whole process; over the suite the
    mappings reach vm.max_map_count (65530 by default) and the next compile fails, which crashed
    the process (see BUILD_NOTES, "The suite and memory mappings")."""
    yield
    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def tiny():
    return resolve_checkpoint("tiny")
