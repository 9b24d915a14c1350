"""Planted state-handling bugs for the diff's detection-power tests, without touching the engine.

Owns: `MutantEngine`, an `Engine` whose public verdict methods misbehave only while one of the
mutant forwards in `MUTANTS` is selected (the math then runs the `xla` forward), and whose fused
speculative step misbehaves while one of `FUSED_MUTANTS` is; `mutant_variants` and
`fused_mutant_variants`, the diff variants that select them. Under any other forward it is the
engine.

Invariant: a mutant changes only what its name says, and only in replays (the diff's reference
always runs `xla`).
"""

from __future__ import annotations

import numpy as np

from metrale_jax.diff import Variant
from metrale_jax.engine.engine import Engine

MUTANTS = {
    "mutant-fold-row": "the GDN fold picks the wrong row",
    "mutant-conv-kept": "the conv window is not rolled back",
    "mutant-commit-off-by-one": "the commit keeps one row too many",
    "mutant-rejected-kv": "a rejected row's KV stays visible",
    "mutant-wrong-slot": "the verify reads another sequence's slot",
    "mutant-prenorm-hidden": "the drafter is fed the pre-norm hidden",
}
#: Bugs of the fused step alone; the first changes only junk no output ever reads.
FUSED_MUTANTS = {
    "mutant-fused-dummy-stash": "the fused step also writes the padding dummy's stash row",
}


def _bump_stash_row(pool, slot):
    return pool.replace(stash=pool.stash.at[slot].add(1.0))


class MutantEngine(Engine):
    """See the module docstring. `mutant` is the selected mutant forward, or None."""

    mutant = None

    def __init__(self, cfg, params, settings, **kw):
        super().__init__(cfg, params, settings, **kw)
        self._base_cfg = cfg

    def set_forward(self, name: str) -> None:
        self.mutant = name if name in MUTANTS or name in FUSED_MUTANTS else None
        super().set_forward("xla" if self.mutant else name)
        prenorm = self.mutant == "mutant-prenorm-hidden"
        self.cfg = self._base_cfg.replace(mtp_hidden_postnorm=False) if prenorm else self._base_cfg

    def disclosure(self, name=None):
        return super().disclosure("xla" if name in MUTANTS or name in FUSED_MUTANTS else name)

    def speculative_step(self, seqs, tokens, ks, num_drafts, **kw):
        out = super().speculative_step(seqs, tokens, ks, num_drafts, **kw)
        if self.mutant == "mutant-fused-dummy-stash":
            slot = np.asarray(self.counts.dummy_slot, np.int32)
            self.pool = self.programs.run("mutant_stash", _bump_stash_row, None, self.pool, slot)
        return out

    def gdn_fold_accepted(self, seqs, rows, ks):
        if self.mutant == "mutant-fold-row":
            rows = [r % k + 1 for r, k in zip(rows, ks)]  # one row late; a full accept takes row 0
        super().gdn_fold_accepted(seqs, rows, ks)

    def commit_accepted_prefixes(self, seqs, rows, ks):
        if self.mutant == "mutant-conv-kept":
            return
        if self.mutant == "mutant-commit-off-by-one":
            rows = [min(r + 1, k) for r, k in zip(rows, ks)]
        super().commit_accepted_prefixes(seqs, rows, ks)

    def rewind(self, seq, rejected):
        if self.mutant == "mutant-rejected-kv" and rejected:
            rejected -= 1
        Engine.rewind(seq, rejected)

    def verify_batched(self, seqs, tokens, ks):
        if self.mutant != "mutant-wrong-slot" or len(seqs) < 2:
            return super().verify_batched(seqs, tokens, ks)
        a, b = seqs[0], seqs[1]
        a.slot, b.slot = b.slot, a.slot
        try:
            return super().verify_batched(seqs, tokens, ks)
        finally:
            a.slot, b.slot = b.slot, a.slot


def mutant_variants(names=MUTANTS) -> list[Variant]:
    """The diff variants of the named mutants, each declared bit-identical to the reference."""
    return [Variant(f"{name} ({MUTANTS[name]})", name) for name in names]


def fused_mutant_variants() -> list[Variant]:
    """The fused-step variants of `FUSED_MUTANTS`, each declared bit-identical."""
    return [Variant(f"{name} ({why})", name, step="fused") for name, why in FUSED_MUTANTS.items()]
