"""Compiled step programs: each transition compiled once per (static config, shape bucket).

Owns: `ProgramCache` — ahead-of-time compilation of the engine's transitions with the pool
donated, the count of compilations (the zero-recompile tests read it), and the disclosure of
what a forward compiled: a digest of each program's optimized HLO, its kernel launches and its
copies of whole pool leaves (which an in-place step must not make).

Invariant: a cached program is reused only for arguments of identical tree structure, shapes
and dtypes; AOT programs never retrace, so a hit costs no compilation.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re

import jax

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


@dataclasses.dataclass(frozen=True)
class ProgramInfo:
    """name; digest of the optimized HLO; launches (top-level device ops); pool_copies: copies
    of a whole pool leaf (a donated array of more than one element), which an in-place step must
    not make."""

    name: str
    digest: str
    launches: int
    pool_copies: int


def _signature(args):
    """Tree structure plus every leaf's (shape, dtype): what decides whether a program fits.
    NOTE: dtype objects, not their names (str(dtype) cost ~8 us a leaf, ~1 ms a step)."""
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


class ProgramCache:
    """Compile-once cache of transitions. `run(name, fn, static, *args)` calls
    `fn(*args, **static)` with args[0] (the pool) donated."""

    def __init__(self):
        self._programs: dict = {}
        self.compilations = 0
        self.info: dict = {}

    def run(self, name: str, fn, static: dict, *args):
        key = (name, tuple(sorted(static.items(), key=lambda kv: kv[0])), _signature(args))
        prog = self._programs.get(key)
        if prog is None:
            jitted = jax.jit(functools.partial(fn, **static), donate_argnums=(0,))
            prog = jitted.lower(*args).compile()
            self.compilations += 1
            text = prog.as_text()
            self.info[key] = ProgramInfo(
                name,
                hashlib.sha256(text.encode()).hexdigest()[:16],
                count_launches(text),
                count_pool_copies(text, args[0]),
            )
            self._programs[key] = prog
        return prog(*args)

    def disclosure(self, forward: str) -> dict:
        """{plan_digest, launches_per_step, programs} over the programs compiled for `forward`
        (keys whose static `ops` has that name), in compilation order."""
        infos = [
            i for k, i in self.info.items() if dict(k[1]).get("ops") is not None and dict(k[1])["ops"].name == forward
        ]
        if not infos:
            return {"plan_digest": None, "launches_per_step": None, "programs": []}
        h = hashlib.sha256("".join(i.digest for i in infos).encode()).hexdigest()[:16]
        steps = [i for i in infos if i.name == "step_rows"]
        return {
            "plan_digest": h,
            "launches_per_step": steps[0].launches if steps else infos[0].launches,
            "programs": [dataclasses.asdict(i) for i in infos],
        }
