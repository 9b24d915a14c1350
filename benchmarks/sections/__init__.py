"""The benchmark's sections, one module each: `COMMANDS` (its subcommands' one-line help and options),
`resolve` (its fields of `Settings`), `run` (the section, by its runner module) and `table` (its results
as a `report.Table`).

Owns: `SECTIONS` (every section's name -> its module, in the order `all` runs them) and `DEFAULT` (what `all`
runs by default; `--smoke` and `--gpu` defaults apart).

Invariant: nothing here (and no section module at import) loads jax or numpy: the CLI builds every
subcommand from these modules before it sets the thread environment, which XLA and OpenBLAS read once
when they start; each `run` imports its runner (`benchmarks.vs_hf`, `benchmarks.e2e`, ...) when called.
"""

from __future__ import annotations

from types import ModuleType

from benchmarks.sections import anatomy, compiles, e2e, forwards, gap, hf, invariant, multiturn, roofline, slots

_MODULES: tuple[ModuleType, ...] = (hf, e2e, anatomy, compiles, forwards, gap, slots, multiturn, invariant, roofline)

#: Section name -> its module, in the order `all` runs them.
SECTIONS: dict[str, ModuleType] = {name: m for m in _MODULES for name in m.COMMANDS}

#: The sections `make bench` runs (`all` without --sections, --smoke or --gpu).
DEFAULT = [
    "hf",
    "hf-45m",
    "hf-300m",
    "hf-0.8b",
    "e2e",
    "anatomy",
    "compile",
    "forwards",
    "gap",
    "slots",
    "multiturn",
    "invariant",
]
#: The smoke run's sections: every one at tiny sizes, the HF comparison at realistic width once (its stand-in).
SMOKE = ["hf", "hf-300m", "e2e", "anatomy", "compile", "forwards", "gap", "slots", "multiturn", "invariant", "roofline"]
