"""Compiled step programs: each transition compiled once per (static config, shape bucket).

Owns: `ProgramCache` — ahead-of-time compilation of the engine's transitions with the pool
donated, the count of compilations (the zero-recompile tests read it), and the disclosure of
what a forward compiled: a digest of each program's optimized HLO and its kernel launches.

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
_LAUNCH_RE = re.compile(r"^\s*(?:ROOT\s+)?\S+\s*=\s*\S+\s+(fusion|custom-call|dot|convolution|scatter|gather|sort|while|conditional)\(", re.M)


@dataclasses.dataclass(frozen=True)
class ProgramInfo:
    name: str
    digest: str
    launches: int


def _signature(args):
    """Tree structure plus every leaf's (shape, dtype): what decides whether a program fits.
    NOTE: dtype objects, not their names (str(dtype) cost ~8 us a leaf, ~1 ms a step)."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    return tree, tuple((x.shape, x.dtype) for x in leaves)


def count_launches(hlo_text: str) -> int:
    """Top-level device launches of an optimized HLO module's entry computation."""
    entry = hlo_text.split("ENTRY", 1)[-1]
    return len(_LAUNCH_RE.findall(entry))


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
            self.info[key] = ProgramInfo(name, hashlib.sha256(text.encode()).hexdigest()[:16], count_launches(text))
            self._programs[key] = prog
        return prog(*args)

    def disclosure(self, forward: str) -> dict:
        """{plan_digest, launches_per_step, programs} over the programs compiled for `forward`
        (keys whose static `ops` has that name), in compilation order."""
        infos = [i for k, i in self.info.items() if dict(k[1]).get("ops") is not None and dict(k[1])["ops"].name == forward]
        if not infos:
            return {"plan_digest": None, "launches_per_step": None, "programs": []}
        h = hashlib.sha256("".join(i.digest for i in infos).encode()).hexdigest()[:16]
        steps = [i for i in infos if i.name == "step_rows"]
        return {
            "plan_digest": h,
            "launches_per_step": steps[0].launches if steps else infos[0].launches,
            "programs": [dataclasses.asdict(i) for i in infos],
        }
