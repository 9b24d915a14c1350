"""Activation memory for the planner: XLA's own memory analysis of the engine's compiled step programs.

Owns: the choice of the serve's step programs it charges (`step_programs`: of the engine's own
program list, `engine.program_list.serve_programs`, the model's programs at the largest shapes,
on abstract weights and pool — nothing is allocated), their compilation for the default backend
by the engine's own `engine.programs.compile_transition`, the on-disk cache of each program's
`memory_analysis()`, and the affine model the inverse queries' probes use.

What is charged: per program, `temp_size_in_bytes` (XLA's scratch) plus the outputs that do not
alias the donated pool (`output_size_in_bytes − alias_size_in_bytes`: logits, argmax, hidden
rows); the arguments (weights and pools) are charged elsewhere. The activation figure is the
peak over the programs (they run one at a time).

The programs, at the serve's largest shapes (`PoolCounts` of the evaluation; `_largest`):
- prefill: `transitions.prefill_chunk` over one full chunk (`counts.prefill_bucket` of
  `counts.prefill_chunk` tokens: the Engine's largest prefill bucket);
- decode / verify: `transitions.step_rows` at `bucket_width(real_slots)` sequences, T = 1 / K;
- propose: `transitions.propose` at that width with `num_drafts` drafts (drafter serves only);
- speculative: `transitions.speculative_step` (the fused scheduler step `Engine.speculative_step`
  runs: write-on-accept verify at that width, T = K, then `num_drafts` drafts with the drafter,
  none without) for speculative serves with snapshot rollback (replay rollback runs the composed
  programs only). The composed programs stay planned: `diff` and replay rollback run them.

Invariants:
- Results are labelled with the backend they were compiled for (`jax.default_backend()` and the
  device kind): XLA's scratch differs between backends.
- A program's analysis is cached on disk under a key of everything that determines the
  compiled program (program, model config, counts, argument shapes and dtypes, static flags,
  forward, JAX/jaxlib versions, backend, and a digest of the engine, model and kernel sources), so a
  warm evaluation compiles nothing.
- Within one "family" (every shape but the two paged-KV block counts), an evaluation asked for
  exactly is compiled at its own shapes (the first becomes the family's anchor); a probe
  (`exact=False`) of the same family is the anchor plus slopes per KV block and per drafter KV
  block, each measured by compiling the anchor with only that block count moved to the other
  end of the serve's range (1 or `max_seq_len` tokens). XLA's scratch holds copies of KV slices,
  so it grows with the blocks: affinely for decode, verify and propose; nearly so for prefill,
  whose scratch XLA packs differently at few blocks (tests/test_memory_activations.py bounds an
  interpolated probe against the program compiled at its own shapes).
- A probe that changes the slot count (`--slots auto`) is a new family: compiled at its shapes.
- A model of G >= 3 layer groups (`model.layer_groups.layer_groups`) is compiled at its first group and
  its first two (`DEPTH_PROBE_GROUPS`, `truncate_groups`: same widths, MTP layers and counts),
  and each program's bytes at G groups are the affine extension of the two: t1 + (t2 - t1)(G - 1);
  a program that runs no trunk layer (`Program.trunk_free`: the propose) at the first only.
  The list layout unrolls the layers, and what a program holds across layers adds the same bytes
  per group; the transients (a layer's, the MTP head's, the lm_head's) do not depend on the
  depth. On the backends of `DEPTH_PROBE_BACKENDS` only; `full_depth=True` compiles at the
  model's own depth (the tests compare both).
  NOTE: this holds only while no program keeps an [L, B, ...] buffer whose peak overtakes the
  transients at some depth: the verify writes each layer's checkpoint as the layer reads its
  state, and the fold selects layer by layer (`engine.transitions`), for that reason.
- The programs of one shape set compile side by side (threads; XLA compiles without the GIL),
  with `ANALYSIS_OPTIONS` (the backend's code-generation options that leave buffer assignment,
  hence `memory_analysis()`, as the Engine's default compile has it).
- Under a tp x ep mesh (the settings' --tensor/--expert-parallel-size) the programs are compiled
  on that mesh of the local devices, with the engine's shardings (`engine.sharding`), and XLA's
  analysis is one device's; `provide_host_devices` gives a CPU host that many devices before
  JAX starts; fewer local devices than the mesh (a started backend) is a `PlanError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from kernels_cpu.rows_matmul.api import rows_kernel_switched_on
from kernels_pallas.ops import Ops
from metrale_jax.checkpoint import bindings, fp8_rows
from metrale_jax.config import ModelConfig
from metrale_jax.engine.capacity import PoolCounts, pool_counts
from metrale_jax.engine.inputs import ModelStatic
from metrale_jax.engine.program_list import Program, serve_programs
from metrale_jax.engine.programs import compile_transition, export_transition
from metrale_jax.engine.settings import EngineSettings
from metrale_jax.engine.sharding import MeshError, abstract_pool, make_mesh, param_shardings
from metrale_jax.memory.errors import PlanError
from metrale_jax.model.fp8_linear import BITS_DTYPE, Fp8BlockWeight
from metrale_jax.model.layer_groups import arrange_layers, layer_groups, truncate_groups
from metrale_jax.model.weight_layout import backend_layout
from metrale_jax.params import init_params, param_specs
from metrale_jax.quantization import Quantization, converts, scale_shape

#: The environment variable naming the cache directory (default `$XDG_CACHE_HOME` or
#: `~/.cache`, then `metrale-jax/activations`).
CACHE_ENV = "METRALE_JAX_ACTIVATIONS_CACHE"
#: Bumped whenever a cache entry's meaning or the key's composition changes.
CACHE_VERSION = 1
_PACKAGE = Path(__file__).resolve().parents[1]
#: Sources that define the compiled programs; their digest is part of every cache key.
_SOURCES = ("engine", "model", "params.py", "config.py")

#: XLA options of the planner's compiles, by backend. NOTE: on CPU the LLVM optimisation level only
#: changes the machine code emitted after buffer assignment, so `memory_analysis()` is the default
#: compile's (tests/test_memory_activations.py compares with the Engine's own programs) at ~60% of
#: the compile time.
ANALYSIS_OPTIONS: dict[str, dict[str, Any]] = {"cpu": {"xla_backend_optimization_level": 0}}

HOW_COMPILED = "compiled"
HOW_CACHED = "cache"
HOW_INTERPOLATED = "interpolated"
#: The depths, in layer groups, a deep model's programs are compiled at, and the backends where
#: the affine extension from them was checked byte for byte against the full depth (elsewhere
#: the programs compile at full depth; `scripts/depth_probe_check.py` checks a backend).
DEPTH_PROBE_GROUPS = (1, 2)
DEPTH_PROBE_BACKENDS = ("cpu",)


def quantised_abstract(params: Any, cfg: ModelConfig, quant: Quantization | None) -> Any:
    """The abstract parameter tree of `cfg` (checkpoint layout) with the leaves an FP8 scheme
    converts as the loader holds them (`Fp8BlockWeight` of e4m3 values' bytes, bf16 block scales and the
    kept rows as their tail), so the step programs compile with their in-product dequantisation.
    Unchanged without an fp8 scheme (NVFP4 is counted in the weights only)."""
    if quant is None or not quant.loadable:
        return params
    specs = param_specs(cfg)
    for b in bindings(cfg):
        node: Any = params
        spec: Any = specs
        for k in b.path:
            node, spec = node[k], spec[k]
        if spec.kind != "linear":
            continue
        rows = fp8_rows(b, lambda n: converts(quant, n, "linear"))
        n8 = int(rows.sum())
        if n8 == 0 or not rows[:n8].all():
            continue
        *lead, total, cols = node.shape
        sds = jax.ShapeDtypeStruct
        leaf = Fp8BlockWeight(
            sds((*lead, n8, cols), BITS_DTYPE),
            sds(scale_shape((*lead, n8, cols), quant.block), jnp.bfloat16),
            None if n8 == total else sds((*lead, total - n8, cols), node.dtype),
            quant.block,
        )
        parent = params
        for k in b.path[:-1]:
            parent = parent[k]
        parent[b.path[-1]] = leaf
    return params


def fp8_abstract_params(cfg: ModelConfig, quant: Quantization | None) -> Any:
    """The abstract parameter tree the loader builds for `cfg` in weight format `quant`
    (`quantised_abstract` over `init_params`' shapes): what a mesh's FP8 block check reads."""
    return quantised_abstract(jax.eval_shape(lambda: init_params(cfg, 0, jnp.bfloat16)), cfg, quant)


def provide_host_devices(count: int) -> None:
    """Make XLA's CPU client start with at least `count` host devices, so the step programs of a
    tp x ep mesh compile on a one-device machine with no `XLA_FLAGS` set by the user.
    NOTE: the count is fixed when JAX starts its backends; once started (another command ran in
    this process) this does nothing and `ActivationModel.mesh` refuses in one line as before."""
    from jax._src import xla_bridge

    if count > 1 and not xla_bridge.backends_are_initialized() and jax.config.jax_num_cpu_devices < count:
        jax.config.update("jax_num_cpu_devices", count)


def default_cache_dir() -> Path:
    """`$METRALE_JAX_ACTIVATIONS_CACHE`, else `$XDG_CACHE_HOME/metrale-jax/activations`, else
    `~/.cache/metrale-jax/activations`."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "metrale-jax" / "activations"


def source_files() -> list[Path]:
    """The sources a compiled step program depends on: the engine, model, params and config
    sources, all of `kernels_pallas` (the `xla` forward runs its reference twins, the `pallas`
    forward its kernels) and of `kernels_cpu` (`linear` runs the CPU rows kernel; its C++ source
    included)."""
    kernels = [_PACKAGE.parent / "kernels_pallas", _PACKAGE.parent / "kernels_cpu"]
    roots = [_PACKAGE / s for s in _SOURCES] + kernels
    return [
        f
        for root in roots
        for f in (sorted(root.rglob("*.py")) + sorted(root.rglob("*.cc")) if root.is_dir() else [root])
    ]


@functools.cache
def source_digest() -> str:
    """sha256 (16 hex) of `source_files()`: paths and contents."""
    h = hashlib.sha256()
    for f in source_files():
        h.update(f.relative_to(_PACKAGE.parent).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def backend_label() -> tuple[str, str]:
    """(`jax.default_backend()`, the first device's kind), e.g. ("cpu", "cpu")."""
    return jax.default_backend(), jax.devices()[0].device_kind


# ---------------------------------------------------------------- the planned programs

#: The programs the planner charges (`program_list.Program.name`): those that run the model.
PLANNED = ("prefill", "decode", "verify", "propose", "speculative")


def _largest(programs: Sequence[Program]) -> tuple[Program, ...]:
    """Of each `PLANNED` kind, the program at the largest shapes (widest batch or prefill bucket,
    then the most drafts), in the list's order; the logits-returning fused steps are the diff's."""
    top: dict[str, Program] = {}
    for p in programs:
        if p.name not in PLANNED or getattr(p.static, "logits", False):
            continue
        rank = (p.width, getattr(p.static, "num_drafts", 0))
        best = top.get(p.name)
        if best is None or rank > (best.width, getattr(best.static, "num_drafts", 0)):
            top[p.name] = p
    return tuple(top.values())


def step_programs(
    config: ModelConfig, counts: PoolCounts, settings: EngineSettings, params: Any, pool: Any, ops: Ops
) -> tuple[Program, ...]:
    """The serve's step programs at its largest shapes: `_largest` of the engine's list
    (`program_list.serve_programs`) on abstract `params` and `pool`."""
    return _largest(serve_programs(config, counts, settings, ops, pool, params))


def exported_step_programs(
    config: ModelConfig, settings: EngineSettings, mesh: AbstractMesh, dtype: Any, ops: Ops, platform: str
) -> dict[str, Any]:
    """{program name: `jax.export.Exported`}: the serve's step programs (`step_programs` at its full
    `pool_counts`) on `mesh`, an abstract mesh of devices that need not be present, weights and
    pool sharded as the engine shards them, lowered for `platform` (`programs.export_transition`)."""
    counts = pool_counts(settings, config)
    params = jax.eval_shape(lambda: arrange_layers(init_params(config, 0, dtype), config, "list"))
    params = jax.tree_util.tree_map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), params, param_shardings(params, config, mesh)
    )
    pool = abstract_pool(config, counts, settings, dtype=dtype, mesh=mesh)
    return {
        p.name: export_transition(p.fn, p.static, p.args, platform)
        for p in step_programs(config, counts, settings, params, pool, ops)
    }


def _signature(tree: Any) -> list:
    """Tree structure, each leaf's shape and dtype, and its partition spec when sharded."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return [str(treedef), [[list(x.shape), str(x.dtype), *_placement(x)] for x in leaves]]


def _placement(x) -> list:
    s = getattr(x, "sharding", None)
    return [dict(s.mesh.shape), str(s.spec)] if isinstance(s, NamedSharding) else []


def _static_text(static: ModelStatic | None) -> dict:
    """The static part's fields as stable text (dataclasses as their field dicts, other objects
    by class; `PoolCounts.kv_tokens`, which no transition reads, left out so workloads sharing
    the block counts share the entry)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(static) if static is not None else ():
        k, v = f.name, getattr(static, f.name)
        if isinstance(v, PoolCounts):
            v = dataclasses.replace(v, kv_tokens=0)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            out[k] = repr(dataclasses.asdict(v))
        elif isinstance(v, (bool, int, float, str)):
            out[k] = v
        else:
            out[k] = type(v).__qualname__
    return out


# ---------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """One program's activation bytes at one shape set: XLA scratch (`temp`) and the outputs not
    aliased onto the donated pool (`outputs`); `how`: compiled, cache or interpolated."""

    name: str
    transition: str
    shape: str
    temp: int
    outputs: int
    how: str

    @property
    def bytes(self) -> int:
        return self.temp + self.outputs


@dataclasses.dataclass(frozen=True)
class Activations:
    """The step programs' activation bytes at one evaluation, and what they were compiled for."""

    backend: str
    device_kind: str
    forward: str
    jax_version: str
    programs: tuple[ProgramMemory, ...]
    note: str = ""

    @property
    def peak(self) -> ProgramMemory:
        return max(self.programs, key=lambda p: p.bytes)

    @property
    def bytes(self) -> int:
        """The activation figure: the peak program's scratch + fresh outputs."""
        return self.peak.bytes if self.programs else 0

    @property
    def label(self) -> str:
        return f"{self.backend} ({self.device_kind})"


# ---------------------------------------------------------------- the model


class ActivationModel:
    """Activation bytes of a model's step programs at any `(settings, counts)`, compiled at most
    once per distinct shape set (memory, then disk cache), interpolated for probes.

    `programs`: the report names to evaluate (default all; tests may restrict).
    Counters: `compiled` (programs compiled by this process), `compile_seconds` (summed over the
    compiling threads), `compile_wall_seconds` (wall time of the evaluations that compiled: what a
    user waits; less than the sum where programs compile side by side), `cache_hits`.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: Any,
        *,
        forward: str = "xla",
        cache_dir: Path | None = None,
        programs: tuple[str, ...] | None = None,
        full_depth: bool = False,
        quantization: Quantization | None = None,
    ):
        self.config = config
        self.quantization = quantization
        self.full_depth = full_depth
        self.dtype = dtype
        self.forward = forward
        self.cache_dir = cache_dir if cache_dir is not None else default_cache_dir()
        self.only = programs
        self.compiled = 0
        self.compile_seconds = 0.0
        self.compile_wall_seconds = 0.0
        self.cache_hits = 0
        self.backend, self.device_kind = backend_label()
        self._ops: Ops | None = None
        self._params: dict[ModelConfig, Any] = {}
        self._points: dict[tuple, dict[str, ProgramMemory]] = {}
        self._anchor: dict[tuple, PoolCounts] = {}
        self._lock = threading.Lock()

    # -- inputs

    @property
    def ops(self) -> Ops:
        if self._ops is None:
            from metrale_jax.engine.engine import make_ops

            self._ops = make_ops(self.forward)
        return self._ops

    def ops_for(self, settings: EngineSettings) -> Ops:
        """The ops the engine runs at `settings`: `ops`, or with --batch-invariant the forward's invariant variant."""
        if not settings.batch_invariant:
            return self.ops
        from metrale_jax.engine.engine import make_ops

        return make_ops(self.forward, batch_invariant=True)

    def params(self, cfg: ModelConfig):
        """The Engine's parameter tree of `cfg` (its default layout, `list`), abstract."""
        if cfg not in self._params:
            dtype = self.dtype
            self._params[cfg] = jax.eval_shape(lambda: arrange_layers(init_params(cfg, 0, dtype), cfg, "list"))
        return self._params[cfg]

    def depths(self) -> tuple[ModelConfig, ...]:
        """The configs the programs compile at: the model's own, or its `DEPTH_PROBE_GROUPS`
        truncations (see the module docstring)."""
        if (
            self.full_depth
            or self.backend not in DEPTH_PROBE_BACKENDS
            or layer_groups(self.config) <= max(DEPTH_PROBE_GROUPS)
        ):
            return (self.config,)
        return tuple(truncate_groups(self.config, g) for g in DEPTH_PROBE_GROUPS)

    def mesh(self, settings: EngineSettings) -> Mesh | None:
        """The local devices' mesh the settings name (None: one device). Raises PlanError when
        fewer devices are present."""
        tp, ep = settings.tensor_parallel_size, settings.expert_parallel_size
        try:
            return make_mesh(self.config, tp, ep)
        except MeshError as e:
            raise PlanError(
                f"activations per device compile on the {tp} x {ep} mesh: {e} (on CPU set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={tp * ep}, or pass --no-activations)"
            ) from None

    def programs_at(
        self, settings: EngineSettings, counts: PoolCounts, cfg: ModelConfig | None = None
    ) -> tuple[Program, ...]:
        """The abstract step programs of `cfg` (default: the model's) at `counts` (pool traced with
        `allocate_pool`), sharded as the engine shards them under the settings' mesh."""
        cfg = self.config if cfg is None else cfg
        dtype, mesh = self.dtype, self.mesh(settings)
        pool = abstract_pool(cfg, counts, settings, dtype=dtype, mesh=mesh)
        params = quantised_abstract(jax.tree_util.tree_map(lambda x: x, self.params(cfg)), cfg, self.quantization)
        if mesh is None:
            params = jax.eval_shape(lambda p: backend_layout(p, cfg, None), params)
        else:
            params = jax.tree_util.tree_map(
                lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                params,
                param_shardings(params, cfg, mesh),
            )
        progs = step_programs(cfg, counts, settings, params, pool, self.ops_for(settings))
        return tuple(p for p in progs if self.only is None or p.name in self.only)

    # -- one shape set, exactly

    def _key(self, p: Program) -> str:
        doc = {
            "version": CACHE_VERSION,
            "program": p.name,
            "transition": p.transition,
            "args": _signature(p.args),
            "static": _static_text(p.static),
            "forward": self.forward,
            "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
            "backend": [self.backend, self.device_kind],
            "options": ANALYSIS_OPTIONS.get(self.backend),
            "source": source_digest(),
            # NOTE: the switch, not whether the kernel builds here: asking would build it on every plan.
            "cpu_rows_kernel": rows_kernel_switched_on(),
        }
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()

    #: Why the disk cache could not be written this run (None: it could, or was not needed).
    cache_warning: str | None = None

    def _read(self, key: str) -> dict | None:
        """The cached entry `key`, or None when absent, unreadable, malformed (not an object of
        non-negative byte counts with alias <= output) or foreign (another backend, device kind
        or JAX version): such an entry is recompiled and rewritten."""
        try:
            entry = json.loads((self.cache_dir / f"{key}.json").read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            return None
        counts = ("temp_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes")
        if not isinstance(entry, dict) or not all(
            isinstance(entry.get(k), int) and not isinstance(entry[k], bool) and entry[k] >= 0 for k in counts
        ):
            return None
        mine = {"backend": self.backend, "device_kind": self.device_kind, "jax": jax.__version__}
        if (
            any(entry.get(k) != v for k, v in mine.items())
            or entry["alias_size_in_bytes"] > entry["output_size_in_bytes"]
        ):
            return None
        return entry

    def _write(self, key: str, entry: dict) -> None:
        """Store `entry` under `key`: written to a temporary file of its own, then renamed over
        the entry (concurrent writers never interleave, an interrupt leaves no partial entry).
        An unwritable cache directory is no cache: `cache_warning` says why."""
        tmp = None
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.cache_dir, prefix=f".{key}.", suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(entry, indent=1))
            os.replace(tmp, self.cache_dir / f"{key}.json")
            tmp = None
        except OSError as e:
            self.cache_warning = (
                f"the activation cache {self.cache_dir} is not writable ({e.strerror or type(e).__name__}): "
                "the analyses compiled now are not kept"
            )
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def _analyse(self, p: Program) -> ProgramMemory:
        key = self._key(p)
        entry = self._read(key)
        how = HOW_CACHED
        if entry is None:
            t0 = time.perf_counter()
            ma = compile_transition(p.fn, p.static, p.args, ANALYSIS_OPTIONS.get(self.backend)).memory_analysis()
            seconds = time.perf_counter() - t0
            with self._lock:
                self.compiled += 1
                self.compile_seconds += seconds
            entry = {
                "program": p.name,
                "shape": p.shape,
                "backend": self.backend,
                "device_kind": self.device_kind,
                "jax": jax.__version__,
                "temp_size_in_bytes": int(ma.temp_size_in_bytes),
                "argument_size_in_bytes": int(ma.argument_size_in_bytes),
                "output_size_in_bytes": int(ma.output_size_in_bytes),
                "alias_size_in_bytes": int(ma.alias_size_in_bytes),
                "compile_seconds": round(seconds, 3),
            }
            self._write(key, entry)
            how = HOW_COMPILED
        else:
            with self._lock:
                self.cache_hits += 1
        fresh = entry["output_size_in_bytes"] - entry["alias_size_in_bytes"]
        return ProgramMemory(p.name, p.transition, p.shape, entry["temp_size_in_bytes"], fresh, how)

    def exact(self, settings: EngineSettings, counts: PoolCounts) -> dict[str, ProgramMemory]:
        """Every program's bytes at exactly `counts` (memory, disk cache, else compiled), at the
        model's depth or extended from the probe depths (see the module docstring)."""
        point = (_family(settings, counts), counts.kv_blocks, counts.draft_kv_blocks)
        if point not in self._points:
            depths = self.depths()
            per_depth = [self.programs_at(settings, counts, cfg) for cfg in depths]
            # A trunk-free program compiles at the first depth only (its bytes are the same at each).
            per_depth[1:] = [tuple(p for p in progs if not p.trunk_free) for progs in per_depth[1:]]
            # NOTE: XLA compiles without the GIL: the programs compile side by side, one per core;
            # the longest (most layers) first, so the last to start is a short one.
            flat = [p for progs in reversed(per_depth) for p in progs]
            compiled, t0 = self.compiled, time.perf_counter()
            with ThreadPoolExecutor(max(1, min(len(flat), os.cpu_count() or 1))) as pool:
                done = dict(zip(map(id, flat), pool.map(self._analyse, flat)))
            if self.compiled > compiled:
                self.compile_wall_seconds += time.perf_counter() - t0
            analysed = [{p.name: done[id(p)] for p in progs} for progs in per_depth]
            if len(analysed) == 1:
                self._points[point] = analysed[0]
            else:
                groups = layer_groups(self.config)
                first, second = analysed
                self._points[point] = {name: _extend(m, second.get(name), groups) for name, m in first.items()}
        return self._points[point]

    # -- any evaluation

    def at(self, settings: EngineSettings, counts: PoolCounts, *, exact: bool = True) -> Activations:
        """The activations at `counts`: compiled (or cached) at these shapes when `exact`, when
        already known, or when nothing of this family is; else the family anchor's affine model
        in the KV block counts."""
        fam = _family(settings, counts)
        known = (fam, counts.kv_blocks, counts.draft_kv_blocks) in self._points
        if exact or known or fam not in self._anchor:
            rows = self.exact(settings, counts)
            self._anchor.setdefault(fam, counts)
            return self._result(tuple(rows.values()))
        return self._result(
            self._interpolate(settings, counts, fam),
            note=(f"affine in KV blocks from the compiled anchor at {self._anchor[fam].kv_blocks} blocks"),
        )

    def _interpolate(self, settings, counts, fam) -> tuple[ProgramMemory, ...]:
        anchor = self._anchor[fam]
        base = self.exact(settings, anchor)
        # the far end of the serve's range for each block count
        hi = pool_counts(settings, self.config)
        lo = pool_counts(settings, self.config, tokens_per_seq=1)
        slopes: dict[str, list[Fraction]] = {name: [Fraction(0)] * 4 for name in base}
        for field, idx in (("kv_blocks", 0), ("draft_kv_blocks", 2)):
            a = getattr(anchor, field)
            b = getattr(hi, field) if getattr(hi, field) != a else getattr(lo, field)
            if a == 0 or b == a or getattr(counts, field) == a:
                continue
            moved = self.exact(settings, dataclasses.replace(anchor, **{field: b}))
            for name, m in moved.items():
                slopes[name][idx] = Fraction(m.temp - base[name].temp, b - a)
                slopes[name][idx + 1] = Fraction(m.outputs - base[name].outputs, b - a)
        dk = counts.kv_blocks - anchor.kv_blocks
        dd = counts.draft_kv_blocks - anchor.draft_kv_blocks
        out = []
        for name, m in base.items():
            s = slopes[name]
            out.append(
                dataclasses.replace(
                    m,
                    temp=m.temp + math.ceil(s[0] * dk + s[2] * dd),
                    outputs=m.outputs + math.ceil(s[1] * dk + s[3] * dd),
                    how=HOW_INTERPOLATED,
                )
            )
        return tuple(out)

    def _result(self, rows: tuple[ProgramMemory, ...], note: str = "") -> Activations:
        return Activations(self.backend, self.device_kind, self.forward, jax.__version__, rows, note)


def _extend(one: ProgramMemory, two: ProgramMemory | None, groups: int) -> ProgramMemory:
    """A program's bytes at `groups` layer groups from its analyses at 1 and 2 groups (affine);
    `two` None: a trunk-free program, the same at every depth."""
    if two is None:
        return dataclasses.replace(one, how=f"{one.how}, depth {DEPTH_PROBE_GROUPS[0]} group (runs no trunk layer)")
    assert (one.name, one.shape) == (two.name, two.shape)
    how = HOW_COMPILED if HOW_COMPILED in (one.how, two.how) else one.how
    return dataclasses.replace(
        one,
        temp=one.temp + (two.temp - one.temp) * (groups - 1),
        outputs=one.outputs + (two.outputs - one.outputs) * (groups - 1),
        how=f"{how}, depth {DEPTH_PROBE_GROUPS[0]}+{DEPTH_PROBE_GROUPS[1]} groups",
    )


def _family(settings: EngineSettings, counts: PoolCounts) -> tuple:
    """Everything a step program's shapes depend on except the two paged-KV block counts (and
    `kv_tokens`, which no shape reads)."""
    neutral = dataclasses.replace(counts, kv_blocks=0, draft_kv_blocks=0, kv_tokens=0)
    return (
        neutral,
        settings.max_seq_len,
        settings.kv_cache_dtype,
        settings.ssm_h_dtype,
        settings.num_drafts,
        settings.tensor_parallel_size,
        settings.expert_parallel_size,
    )
