"""Compiled step programs: each transition compiled once per (static config, shape bucket).

Owns: `ProgramCache` — ahead-of-time compilation of the engine's transitions with the pool
donated, the count of compilations (the zero-recompile tests read it), and the disclosure of
what a forward compiled: a digest of each program's optimized HLO (its computation, without the
source locations XLA records), its kernel launches and its copies of whole pool leaves (which an
in-place step must not make).

Invariants:
- A cached program is reused only for the same static part and arguments of identical tree
  structure, shapes and dtypes; AOT programs never retrace, so a hit costs no compilation.
- `compile_transition` is the one way a transition is compiled: the engine's cache and the
  memory planner (`memory/activations.py`) both call it, so the planner analyses the program
  the engine runs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
from collections.abc import Callable
from typing import Any

import jax

from metrale_jax.engine.inputs import ModelStatic

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
    not make."""

    name: str
    digest: str
    launches: int
    pool_copies: int


def _signature(args: tuple) -> tuple:
    """Tree structure plus every leaf's (shape, dtype): what decides whether a program fits.
    NOTE: dtype objects, not their names: `str(dtype)` per leaf would show in every step's host time."""
    leaves, tree = jax.tree_util.tree_flatten(args)
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


def compile_transition(fn: Callable, static: ModelStatic | None, args: tuple) -> Any:
    """`fn(*args, static=static)` (`fn(*args)` when static is None) compiled ahead of time for
    `args` (arrays or `jax.ShapeDtypeStruct`s), with args[0], the pool, donated."""
    call = fn if static is None else functools.partial(fn, static=static)
    return jax.jit(call, donate_argnums=(0,)).lower(*args).compile()


class ProgramCache:
    """Compile-once cache of transitions. `run(name, fn, static, *args)` calls
    `fn(*args, static=static)` (or `fn(*args)` without a static part) with args[0] (the pool)
    donated. Programs are keyed by (name, static, argument signature)."""

    def __init__(self) -> None:
        self._programs: dict[tuple, Any] = {}
        self.compilations = 0
        self.info: dict[tuple, ProgramInfo] = {}

    def run(self, name: str, fn: Callable, static: ModelStatic | None, *args):
        key = (name, static, _signature(args))
        prog = self._programs.get(key)
        if prog is None:
            prog = compile_transition(fn, static, args)
            self.compilations += 1
            text = prog.as_text()
            self.info[key] = ProgramInfo(
                name,
                hashlib.sha256(computation_text(text).encode()).hexdigest()[:16],
                count_launches(text),
                count_pool_copies(text, args[0]),
            )
            self._programs[key] = prog
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
