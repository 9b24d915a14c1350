"""Compiled step programs: each transition compiled once per (static config, shape bucket).

Owns: `ProgramCache` — ahead-of-time compilation of the engine's transitions (on first use, or
before it: `ProgramCache.lower`) with the pool
donated and the host inputs packed into one int32 vector per call (`HostPacking`,
`PackedProgram`), the count of compilations (the zero-recompile tests read it) and the seconds
they took, and the disclosure of what a forward compiled: a digest of each program's optimized
HLO (its computation, without the source locations XLA records), its kernel launches, its copies
of whole pool leaves and its materialisations of a layer's weights (neither of which a step that
updates the pool in place and reads its weights in place makes).

Invariants:
- A cached program is reused only for the same static part and arguments of identical tree
  structure, shapes and dtypes; AOT programs never retrace, so a hit costs no compilation.
- A call moves its host inputs (`inputs.HostInput`) to the device as one array; the compiled
  program rebuilds them with static slices, so their values, shapes and dtypes are the engine's.
- `compile_transition` is the one way a transition is compiled: the engine's cache and the
  memory planner (`memory/activations.py`) both call it, so the planner analyses the program
  the engine runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import math
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from kernels_pallas.common import TRITON_CALL
from metrale_jax.engine.inputs import HostInput, ModelStatic
from metrale_jax.model.invariant import batch_invariant_products

# Ops of an optimized XLA program that launch device work on their own (fusions and library
# calls); what runs inside a fusion is one launch.
_LAUNCH_RE = re.compile(
    r"^\s*(?:ROOT\s+)?\S+\s*=\s*\S+\s+(fusion|custom-call|dot|convolution|scatter|gather|sort|while|conditional)\(",
    re.M,
)


# A copy op of the entry computation and its result type without layout: "f32[2,5,64]".
_COPY_RE = re.compile(r"=\s*(\w+\[[\d,]*\])(?:\{[^}]*\})?\s+copy\(", re.M)
_HLO_DTYPES = {
    "float32": "f32",
    "bfloat16": "bf16",
    "float16": "f16",
    "int32": "s32",
    "uint8": "u8",
    "int8": "s8",
    "bool": "pred",
    "float8_e4m3fn": "f8e4m3fn",
    "float8_e5m2": "f8e5m2",
}


# Where each op came from in the Python source: the stack-frame tables of the module header and
# each instruction's `metadata={...}`. Neither is part of the computation.
_SOURCE_TABLES_RE = re.compile(r"^(?:FileNames|FunctionNames|FileLocations|StackFrames)\n(?:.+\n)*", re.M)
_METADATA_RE = re.compile(r", metadata=\{[^}]*\}")


def computation_text(hlo_text: str) -> str:
    """An optimized HLO module's text without its source locations: the same computation traced
    from code at other files or lines gives the same text."""
    return _METADATA_RE.sub("", _SOURCE_TABLES_RE.sub("", hlo_text))


@dataclasses.dataclass(frozen=True)
class ProgramInfo:
    """name; digest of the optimized HLO's `computation_text`; launches (top-level device ops); pool_copies: copies
    of a whole pool leaf (a donated array of more than one element), which an in-place step must
    not make; param_copies: materialisations of a layer's weights (`count_param_copies`), which a
    step that reads its weights in place does not make."""

    name: str
    digest: str
    launches: int
    pool_copies: int
    param_copies: int


def _signature(arg: Any) -> tuple:
    """Tree structure plus every leaf's (shape, dtype): what decides whether a program fits.
    NOTE: dtype objects, not their names: `str(dtype)` per leaf would show in every step's host time."""
    leaves, tree = jax.tree_util.tree_flatten(arg)
    return tree, tuple((x.shape, x.dtype) for x in leaves)


def count_launches(hlo_text: str) -> int:
    """Top-level device launches of an optimized HLO module's entry computation."""
    entry = hlo_text.split("ENTRY", 1)[-1]
    return len(_LAUNCH_RE.findall(entry))


def count_pool_copies(hlo_text: str, pool) -> int:
    """Copies in the entry computation whose result has the type of a leaf of `pool` with more
    than one element (XLA copies a donated buffer when it cannot update it in place)."""
    types = {
        f"{_HLO_DTYPES.get(str(x.dtype), str(x.dtype))}[{','.join(map(str, x.shape))}]"
        for x in jax.tree_util.tree_leaves(pool)
        if x.size > 1
    }
    entry = hlo_text.split("ENTRY", 1)[-1]
    return sum(t in types for t in _COPY_RE.findall(entry))


# A computation's header line ("ENTRY %main.3 (...) -> ... {", "%body.1 (...) -> ... {").
_COMPUTATION_RE = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
# An instruction's name and what follows its "=": "  ROOT %x.1 = f32[2]{0} add(%a, %b), metadata=...".
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_OPCODE_RE = re.compile(r"\s*([\w\-]+)\(([^)]*)\)(.*)$")
_NAME_RE = re.compile(r"%([\w.\-]+)")
_DIMS_RE = re.compile(r"^\w+\[([\d,]*)\]")
_INDEX_RE = re.compile(r"index=(\d+)")
_WEIGHT_RE = re.compile(r"%([\w.\-]+) = \S+ parameter\(\d+\).*?op_name=\"(params[^\"]*)\"")
# Ops that materialise (part of) an operand in a new buffer; a fusion of these, of the ops below
# and of index arithmetic (integer or predicate results) is a data movement. Not `gather`: it
# looks rows up (embedding rows by token), which a long prefill's rows may outnumber.
_MATERIALISING = frozenset({"copy", "transpose", "slice", "dynamic-slice"})
_MOVEMENT = _MATERIALISING | {"parameter", "bitcast", "reshape", "broadcast", "concatenate", "constant", "iota", "pad"}
_INDEX_TYPE_RE = re.compile(r"^(?:s\d+|u\d+|pred)\[")


@dataclasses.dataclass(frozen=True)
class _Instr:
    name: str
    type: str
    op: str
    operands: tuple[str, ...]  # operand names; a parameter's number
    attrs: str


def _type_end(text: str) -> int:
    """The length of the result type that `text` starts with: an array type ("f32[2,3]{1,0}") or
    a parenthesised tuple type, which holds spaces, commas and comments."""
    if not text.startswith("("):
        return len(text.split(" ", 1)[0])
    depth = 0
    for n, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return n + 1
    return len(text)


def _parse_instr(line: str) -> _Instr | None:
    m = _INSTR_RE.match(line)
    if m is None:
        return None
    rest = m.group(2)
    end = _type_end(rest)
    op = _OPCODE_RE.match(rest[end:])
    if op is None:
        return None
    args = op.group(2)
    operands = tuple(_NAME_RE.findall(args)) if op.group(1) != "parameter" else (args.strip(),)
    return _Instr(m.group(1), rest[:end], op.group(1), operands, op.group(3))


def _computations(hlo_text: str) -> tuple[dict[str, list[_Instr]], str]:
    """{computation name: its instructions} of an optimized HLO module's text, and the entry's name."""
    comps: dict[str, list[_Instr]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        if current is None:
            if m := _COMPUTATION_RE.match(line):
                current = comps.setdefault(m.group(2), [])
                entry = m.group(2) if m.group(1) else entry
        elif line.strip() == "}":
            current = None
        elif (instr := _parse_instr(line)) is not None:
            current.append(instr)
    return comps, entry


def _dims(typ: str) -> list[int]:
    m = _DIMS_RE.match(typ)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _called(attrs: str, key: str) -> list[str]:
    """The computations an instruction names under `key` (`calls=%f`, `branch_computations={%a, %b}`)."""
    m = re.search(key + r"=(\{[^}]*\}|%[\w.\-]+)", attrs)
    return _NAME_RE.findall(m.group(1)) if m else []


def count_param_copies(hlo_text: str) -> int:
    """Ops of an optimized HLO module that materialise at least one layer's worth of a weight: a
    copy, transpose, slice or dynamic-slice, or a fusion of nothing but data movement and index
    arithmetic, in the entry computation, its loop bodies and branches, with a weight as an
    operand and a result of at least one layer's worth of that weight's elements.

    A weight is an entry parameter whose name starts with `params` (as `jax.jit` names the leaves
    of the argument `params`), followed through bitcasts, tuples, loops and branches. One layer's
    worth is the whole leaf, or one group's slice of a leaf stacked over the layer groups
    (`layer_groups`, the scan layout). Smaller slices (one expert of an [E, ...] leaf, embedding
    rows) are what a step reads, not a copy of the layer.
    """
    comps, entry = _computations(hlo_text)
    weights = dict(_WEIGHT_RE.findall(hlo_text))
    movement = {c: all(i.op in _MOVEMENT or _INDEX_TYPE_RE.match(i.type) for i in body) for c, body in comps.items()}
    count = 0

    def walk(comp: str, args: list) -> None:
        """args: per parameter of `comp`, the layer elements of the weight it is (a list per tuple index; None)."""
        nonlocal count
        unit: dict[str, Any] = {}
        for i in comps.get(comp, []):
            first = unit.get(i.operands[0]) if i.operands else None
            if i.op == "parameter":
                if comp == entry and i.name in weights:
                    dims = _dims(i.type)
                    unit[i.name] = math.prod(dims[1:] if "layer_groups" in weights[i.name] else dims)
                elif comp != entry and int(i.operands[0]) < len(args):
                    unit[i.name] = args[int(i.operands[0])]
            elif i.op == "bitcast":
                unit[i.name] = first
            elif i.op == "tuple":
                unit[i.name] = [unit.get(o) for o in i.operands]
            elif i.op == "get-tuple-element" and isinstance(first, list) and (m := _INDEX_RE.search(i.attrs)):
                unit[i.name] = first[int(m.group(1))]
            elif i.op == "while":
                for c in _called(i.attrs, "condition") + _called(i.attrs, "body"):
                    walk(c, [first])
                unit[i.name] = first
            elif i.op == "conditional":
                for n, c in enumerate(_called(i.attrs, "branch_computations")):
                    walk(c, [unit.get(i.operands[1 + n])] if n + 1 < len(i.operands) else [])
            elif i.op == "call":
                for c in _called(i.attrs, "to_apply"):
                    walk(c, [unit.get(o) for o in i.operands])
            fused = _called(i.attrs, "calls") if i.op == "fusion" else []
            if i.op in _MATERIALISING or (fused and all(movement.get(c, False) for c in fused)):
                size = math.prod(_dims(i.type)) if _DIMS_RE.match(i.type) else 0
                count += any(isinstance(u, int) and size >= u for u in (unit.get(o) for o in i.operands))

    walk(entry, [])
    return count


def _pool_mesh(pool) -> Any:
    """The mesh (concrete or abstract) the pool's leaves are sharded over (`engine.sharding`), or
    None on one device."""
    for x in jax.tree_util.tree_leaves(pool):
        if isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding):
            return x.sharding.mesh
    return None


@dataclasses.dataclass(frozen=True)
class HostPacking:
    """Where a call's host inputs (`inputs.HostInput` arguments) lie in the one int32 vector that
    carries them to the device: `positions` the argument positions they take, `trees` their tree
    structures, `leaves` each leaf's (shape, dtype), in the order of the vector. A call's other
    arguments (the pool, the params, device arrays) pass as they are, the vector after them.
    NOTE: one host-to-device transfer per call: the compiled call moves each numpy argument on
    its own, at a fixed cost apiece that a small model's step notices."""

    positions: tuple[int, ...]
    trees: tuple[Any, ...]
    leaves: tuple[tuple[tuple[int, ...], Any], ...]

    @classmethod
    def of(cls, args: tuple) -> HostPacking:
        positions = tuple(i for i, x in enumerate(args) if isinstance(x, HostInput))
        flat = [jax.tree_util.tree_flatten(args[i]) for i in positions]
        leaves = tuple((tuple(x.shape), np.dtype(x.dtype)) for ls, _ in flat for x in ls)
        return cls(positions, tuple(t for _, t in flat), leaves)

    @property
    def size(self) -> int:
        return sum(math.prod(shape) for shape, _ in self.leaves)

    def _others(self, args: tuple) -> tuple:
        return tuple(x for i, x in enumerate(args) if i not in self.positions)

    def pack(self, args: tuple) -> tuple:
        """A call's arguments: the others in order, then the host inputs' vector."""
        if not self.positions:
            return args
        leaves = [np.ravel(x) for i in self.positions for x in jax.tree_util.tree_leaves(args[i])]
        return (*self._others(args), np.concatenate(leaves, dtype=np.int32))

    def lowering_args(self, args: tuple) -> tuple:
        """What the packed program is lowered on: the others in order (arrays or shape structs),
        then the vector's shape struct."""
        vector = (jax.ShapeDtypeStruct((self.size,), np.int32),) if self.positions else ()
        return (*self._others(args), *vector)

    def unpack(self, packed: tuple) -> tuple:
        """Inside the trace: `pack`'s output back to the arguments it came from."""
        if not self.positions:
            return packed
        *rest, vector = packed
        out, off = [], 0
        for shape, dtype in self.leaves:
            n = math.prod(shape)
            x = vector[off : off + n].reshape(shape)
            out.append(x != 0 if dtype == np.bool_ else x)
            off += n
        inputs, k = [], 0
        for tree in self.trees:
            inputs.append(jax.tree_util.tree_unflatten(tree, out[k : k + tree.num_leaves]))
            k += tree.num_leaves
        host, others = iter(inputs), iter(rest)
        return tuple(next(host) if i in self.positions else next(others) for i in range(len(rest) + len(inputs)))


class PackedProgram:
    """A compiled transition that takes its arguments as the engine passes them: a call packs the
    host inputs (`HostPacking.pack`) and runs the compiled program; everything else (`as_text`,
    `memory_analysis`, ...) is the compiled program's."""

    def __init__(self, compiled: Any, packing: HostPacking):
        self.compiled = compiled
        self.packing = packing

    def __call__(self, *args):
        return self.compiled(*self.packing.pack(args))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.compiled, name)


def _jitted(fn: Callable, static: ModelStatic | None, args: tuple) -> tuple[Any, Any, HostPacking]:
    """(the transition jitted with the pool donated and its host inputs packed (`HostPacking`),
    the pool's mesh or None, the packing). Under a mesh the returned pool — the output, or its
    last element, as every transition returns it — is constrained to the donated pool's
    shardings, so the pool keeps its layout and the donation aliases it."""
    call = fn if static is None else functools.partial(fn, static=static)
    packing = HostPacking.of(args)
    mesh = _pool_mesh(args[0])
    keep = (
        (lambda pool: pool)
        if mesh is None
        else functools.partial(
            jax.lax.with_sharding_constraint, shardings=jax.tree_util.tree_map(lambda x: x.sharding, args[0])
        )
    )

    invariant = getattr(getattr(static, "ops", None), "batch_invariant", False)

    def packed(*a):
        with batch_invariant_products(invariant):  # the batch-invariant forward's products (`model.invariant`)
            out = call(*packing.unpack(a))
        return (*out[:-1], keep(out[-1])) if isinstance(out, tuple) else keep(out)

    # NOTE: the packed program keeps the transition's name and argument names (`params`, ...): XLA
    # records them in each op's metadata, where `count_param_copies` finds the weights.
    names = [n for i, n in enumerate(list(inspect.signature(fn).parameters)[: len(args)]) if i not in packing.positions]
    names += ["host_inputs"] if packing.positions else []
    packed.__signature__ = inspect.Signature(  # type: ignore[attr-defined]  # read by jax for the names
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_ONLY) for n in names]
    )
    packed.__name__ = packed.__qualname__ = getattr(fn, "__name__", packed.__name__)  # the program's name in XLA
    return jax.jit(packed, donate_argnums=(0,)), mesh, packing


def compile_transition(
    fn: Callable, static: ModelStatic | None, args: tuple, options: dict[str, Any] | None = None
) -> PackedProgram:
    """`fn(*args, static=static)` (`fn(*args)` when static is None) compiled ahead of time for
    `args` (arrays or `jax.ShapeDtypeStruct`s), with args[0], the pool, donated, and the host
    inputs moved as one vector (`HostPacking`; the returned program takes `args` as they are).
    Under a mesh (the pool's leaves carry NamedShardings) it is traced under it (`jax.set_mesh`:
    the model reads the tensor groups and the expert devices from it) and keeps the pool's
    shardings (`_jitted`). `options`: XLA compiler options (None: the defaults the engine runs with)."""
    return lower_transition(fn, static, args)(options)


def lower_transition(fn: Callable, static: ModelStatic | None, args: tuple) -> Callable[..., PackedProgram]:
    """`compile_transition`'s first half: the transition traced and lowered here (Python, under
    the GIL), returned as its second half, `compile(options=None) -> PackedProgram`, which XLA
    runs without the GIL (a caller may run it on another thread)."""
    jitted, mesh, packing = _jitted(fn, static, args)
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        lowered = jitted.lower(*packing.lowering_args(args))

    def compile(options: dict[str, Any] | None = None) -> PackedProgram:
        with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
            return PackedProgram(lowered.compile(compiler_options=options), packing)

    return compile


def export_transition(fn: Callable, static: ModelStatic | None, args: tuple, platform: str) -> Any:
    """The program `compile_transition` builds, exported (`jax.export`) for `platform` without its
    devices: `args` are shape structs sharded over an `AbstractMesh` (or unsharded). Lowering only;
    the `pallas` forward's Triton calls are allowed (they have no stability guarantee, which an
    export for lowering checks does not need)."""
    jitted, mesh, packing = _jitted(fn, static, args)
    triton = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
    with contextlib.nullcontext() if mesh is None else jax.sharding.use_abstract_mesh(mesh):
        return jax.export.export(jitted, platforms=[platform], disabled_checks=triton)(*packing.lowering_args(args))


class ProgramCache:
    """Compile-once cache of transitions. `run(name, fn, static, *args)` calls
    `fn(*args, static=static)` (or `fn(*args)` without a static part) with args[0] (the pool)
    donated, compiling it first unless cached; `lower(...)` (the same arguments) prepares it ahead
    of time without running it (`Engine.warm_up`), so the first `run` is a hit. Programs are
    keyed by (name, static, each argument's signature): shapes and dtypes, so an abstract
    argument (`jax.ShapeDtypeStruct`) keys as the array it stands for.

    Arguments are pytrees of immutable arrays, replaced and never edited in place: an argument
    that is the object last passed at its position keeps that object's signature.

    `info` (what `disclosure` reads) holds the programs that ran, in the order they first ran: a
    program compiled ahead of time and never run is not disclosed. The compilations `lower`
    returns may run on several threads at once (XLA compiles without the GIL); `run` and `lower`
    on one."""

    def __init__(self) -> None:
        self._programs: dict[tuple, PackedProgram] = {}
        self._compiled: dict[tuple, ProgramInfo] = {}  # what each program compiled to, run or not
        self._signature_ids: dict[tuple, int] = {}  # each argument signature seen, interned
        self._last: dict[int, tuple[Any, int]] = {}  # per position: the last argument and its signature id
        self._lock = threading.Lock()
        self.compilations = 0
        self.compile_seconds = 0.0  # spent compiling, over every compilation
        self.calls = 0  # programs run (each `run`)
        self.info: dict[tuple, ProgramInfo] = {}

    def _argument_ids(self, args: tuple) -> tuple[int, ...]:
        """The interned signature of each argument.
        NOTE: the engine passes the same params object at every call; flattening its leaves and
        hashing their shapes was the largest host cost of a step on a small model (~60 of ~80
        leaves). A new pool or batch each call is flattened as before."""
        ids = []
        for i, x in enumerate(args):
            last = self._last.get(i)
            if last is None or last[0] is not x:
                last = x, self._signature_ids.setdefault(_signature(x), len(self._signature_ids))
                self._last[i] = last
            ids.append(last[1])
        return tuple(ids)

    def _build(self, key: tuple, fn: Callable, static: ModelStatic | None, args: tuple) -> PackedProgram:
        """Compile the program of `key` and count it."""
        return self._finish(key, args, lower_transition(fn, static, args), time.perf_counter())

    def _finish(self, key: tuple, args: tuple, compile: Callable[[], PackedProgram], t0: float) -> PackedProgram:
        """Compile a lowered program of `key` (`lower_transition`, lowered from `t0` on), describe
        it (`ProgramInfo`) and count it."""
        prog = compile()
        seconds = time.perf_counter() - t0
        text = prog.as_text()
        info = ProgramInfo(
            key[0],
            hashlib.sha256(computation_text(text).encode()).hexdigest()[:16],
            count_launches(text),
            count_pool_copies(text, args[0]),
            count_param_copies(text),
        )
        with self._lock:
            self.compile_seconds += seconds
            self.compilations += 1
            self._programs[key], self._compiled[key] = prog, info
        return prog

    def lower(self, name: str, fn: Callable, static: ModelStatic | None, *args) -> Callable[[], PackedProgram] | None:
        """Ahead of time, without running it: `run(name, fn, static, *args)`'s program (`args`
        arrays or shape structs) traced and lowered here, returned as its compilation, to call on
        any thread, after which a `run` with these arguments is a hit; None when it is cached."""
        with self._lock:
            key = (name, static, self._argument_ids(args))
            if key in self._programs:
                return None
        t0 = time.perf_counter()
        compile = lower_transition(fn, static, args)
        return functools.partial(self._finish, key, args, compile, t0)

    def run(self, name: str, fn: Callable, static: ModelStatic | None, *args):
        key = (name, static, self._argument_ids(args))
        prog = self._programs.get(key)
        if prog is None:
            prog = self._build(key, fn, static, args)
        if key not in self.info:
            self.info[key] = self._compiled[key]
        self.calls += 1
        return prog(*args)

    def disclosure(self, forward: str) -> dict:
        """{plan_digest, launches_per_step, programs} over the programs compiled for `forward`
        (those whose static part's `ops` has that name), in compilation order."""
        infos = [i for k, i in self.info.items() if k[1] is not None and k[1].ops.name == forward]
        if not infos:
            return {"plan_digest": None, "launches_per_step": None, "programs": []}
        h = hashlib.sha256("".join(i.digest for i in infos).encode()).hexdigest()[:16]
        steps = [i for i in infos if i.name == "step_rows"]
        return {
            "plan_digest": h,
            "launches_per_step": steps[0].launches if steps else infos[0].launches,
            "programs": [dataclasses.asdict(i) for i in infos],
        }
