"""Planted state-handling bugs for the diff's detection-power tests, without touching the engine.

Owns: `MutantEngine`, an `Engine` whose verdict steps (`_fold`, `_commit`, `_rewind`, `_stash`: the
seam `engine.verdict` documents) misbehave only while one of the mutant forwards in `MUTANTS` is
selected (the math then runs the `xla` forward), and whose fused speculative step misbehaves while
one of `FUSED_MUTANTS` is; `mutant_variants` and `fused_mutant_variants`, the diff variants that
select them. Under any other forward it is the engine, unless a shared mutant is planted.

Shared mutants (`SHARED_MUTANTS`, planted with `planted(engine, name)`): bugs in the code every
forward and every run shares, the reference's included, each in the engine's own methods or in
the inputs it hands one program (`ProgramCache.run` wrapped); `stash_error` is the direct check
of the accepted row's stash that tests/test_speculative.py runs.

Invariants: a mutant changes only what its name says; a replay-only mutant only in replays (the
diff's reference always runs `xla`); a shared one in every run until `planted` exits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from metrale_jax.diff import Variant
from metrale_jax.engine import transitions
from metrale_jax.engine.engine import Engine
from metrale_jax.engine.inputs import PAD_TOKEN
from metrale_jax.engine.speculative import DraftSchedule

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


#: Bugs in shared code: every run of a diff (reference, replays, oracle) runs them.
SHARED_MUTANTS = {
    "fold-row-late": "the GDN fold copies verify row na + 1 (a partial accept)",
    "fold-row-early": "the GDN fold copies verify row na - 1 (a partial accept with na >= 1)",
    "full-as-partial": "a full accept is folded as a partial one (copies verify row K - 1)",
    "conv-commit-off-by-one": "the conv commit keeps the window one row late",
    "rejected-kv-visible": "the rewind leaves one rejected row (its KV visible, the length too long)",
    "stash-wrong-row": "the stash takes the hidden of the row after the accepted one",
    "propose-untrimmed": "the drafter is not trimmed back to the committed context after a propose",
    "write-on-accept-shifted": "the verify writes its per-row GDN states one verify row late",
    "prefill-chunk-overlap": "a prefill chunk after the first starts one position early",
    "padding-slot-0": "a verify's padding sequences address slot 0 instead of the dummy slot",
    "block-table-off-by-one": "a verify's block table entry j holds the sequence's block j + 1",
    "restore-skips-conv": "a swap-in restores everything but the GDN conv window",
    "checkpoint-restore-skips-conv": "replay rollback's checkpoint restore puts back the GDN h but not the conv window",
}


#: Sub-bound shared mutants: state bugs whose effect stays inside the oracle's bounded contract (one ULP of a
#: committed state leaf), so the bounded diff PASSes them and only the bit-identical contract of --batch-invariant
#: FAILs them (tests/test_batch_invariant.py).
SUB_BOUND_MUTANTS = {
    "fold-ulp": "the GDN fold leaves the folded state one ULP off (a recurrence term summed in another order)",
    "conv-commit-ulp": "the conv commit leaves the window one ULP off (a commit that rounds through another type)",
    "stash-ulp": "the stash holds the accepted row's hidden one ULP off (a norm epsilon one ULP off)",
}


def _ulp_up(pool, slots, leaf: str):
    """pool with `leaf` (trunk.gdn_h, trunk.gdn_conv or stash) one ULP up at `slots`."""
    if leaf == "stash":
        return pool.replace(stash=pool.stash.at[slots].set(jnp.nextafter(pool.stash[slots], jnp.inf)))
    x = getattr(pool.trunk, leaf)
    return pool.replace(trunk=pool.trunk.replace(**{leaf: x.at[:, slots].set(jnp.nextafter(x[:, slots], jnp.inf))}))


@contextlib.contextmanager
def planted(engine, name: str):
    """Plant shared mutant `name` (of `SHARED_MUTANTS` or `SUB_BOUND_MUTANTS`) in `engine` (a `MutantEngine`)."""
    assert name in SHARED_MUTANTS or name in SUB_BOUND_MUTANTS, name
    engine.shared = name
    try:
        yield
    finally:
        engine.shared = None


def _bump_stash_row(pool, slot):
    return pool.replace(stash=pool.stash.at[slot].add(1.0))


class MutantEngine(Engine):
    """See the module docstring. `mutant` is the selected mutant forward, or None."""

    mutant = None
    shared: str | None = None

    def __init__(self, cfg, params, settings, **kw):
        super().__init__(cfg, params, settings, **kw)
        self._base_cfg = cfg
        run = self.programs.run

        def planted_run(name, fn, static, *args):
            skips = {"restore-skips-conv": "write_state", "checkpoint-restore-skips-conv": "restore_ckpt"}
            if name == skips.get(self.shared or ""):
                kept = jnp.array(args[0].trunk.gdn_conv)  # a copy: the program takes the pool donated
                pool = run(name, fn, static, *args)
                return pool.replace(trunk=pool.trunk.replace(gdn_conv=kept))
            if self.shared == "prefill-chunk-overlap" and name == "prefill_chunk" and args[2].start[0] > 0:
                args[2].start[0] -= 1
            if name == "step_rows" and static.verify:
                self._plant_verify(args[2])
            return run(name, fn, static, *args)

        self.programs.run = planted_run  # type: ignore[method-assign]

    def _plant_verify(self, batch) -> None:
        """A shared mutant of the verify's addressing, applied to its (host numpy) `StepBatch`."""
        real = batch.lens > 0
        if self.shared == "write-on-accept-shifted":
            batch.vrow_base[real] += 1
        elif self.shared == "padding-slot-0":
            batch.slots[~real] = 0
        elif self.shared == "block-table-off-by-one":
            batch.block_tables[real, :-1] = batch.block_tables[real, 1:].copy()

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

    def _fold(self, seqs, rows, ks):
        if self.mutant == "mutant-fold-row":
            rows = [r % k + 1 for r, k in zip(rows, ks)]  # one row late; a full accept takes row 0
        if self.shared == "fold-row-late":
            rows = [min(r + 1, k) if r < k else r for r, k in zip(rows, ks)]
        if self.shared == "fold-row-early":
            rows = [max(r - 1, 1) if r < k else r for r, k in zip(rows, ks)]
        if self.shared == "full-as-partial":
            ks = [k + (r == k) for r, k in zip(rows, ks)]
        super()._fold(seqs, rows, ks)
        if self.shared == "fold-ulp":
            self._sub_bound(seqs, "gdn_h")

    def _sub_bound(self, seqs, leaf: str) -> None:
        slots = np.asarray([s.slot for s in seqs], np.int32)
        self.pool = self.programs.run(
            f"mutant_{leaf}_ulp", functools.partial(_ulp_up, leaf=leaf), None, self.pool, slots
        )

    def _commit(self, seqs, rows, ks):
        if self.mutant == "mutant-conv-kept":
            return
        if self.mutant == "mutant-commit-off-by-one" or self.shared == "conv-commit-off-by-one":
            rows = [min(r + 1, k) for r, k in zip(rows, ks)]
        super()._commit(seqs, rows, ks)
        if self.shared == "conv-commit-ulp":
            self._sub_bound(seqs, "gdn_conv")

    def _rewind(self, seq, rejected):
        if (self.mutant == "mutant-rejected-kv" or self.shared == "rejected-kv-visible") and rejected:
            rejected -= 1
        super()._rewind(seq, rejected)

    def _stash(self, seqs, rows):
        if self.shared == "stash-wrong-row":
            rows = [r + 1 for r in rows]
        super()._stash(seqs, rows)
        if self.shared == "stash-ulp":
            self._sub_bound(seqs, "stash")

    def trim_proposer(self, seq, keep=0):
        if self.shared != "propose-untrimmed":
            super().trim_proposer(seq, keep)

    def verify_batched(self, seqs, tokens, ks, sampling=None):
        if self.mutant != "mutant-wrong-slot" or len(seqs) < 2:
            return super().verify_batched(seqs, tokens, ks, sampling)
        a, b = seqs[0], seqs[1]
        a.slot, b.slot = b.slot, a.slot
        try:
            return super().verify_batched(seqs, tokens, ks, sampling)
        finally:
            a.slot, b.slot = b.slot, a.slot


def mutant_variants(names=MUTANTS) -> list[Variant]:
    """The diff variants of the named mutants, each declared bit-identical to the reference."""
    return [Variant(f"{name} ({MUTANTS[name]})", name) for name in names]


def fused_mutant_variants() -> list[Variant]:
    """The fused-step variants of `FUSED_MUTANTS`, each declared bit-identical."""
    return [Variant(f"{name} ({why})", name, step="fused") for name, why in FUSED_MUTANTS.items()]


def stash_error(engine, prompt) -> float:
    """The stash after a verify and its verdict against the plain path's. Sequence c prefills
    `prompt` and decodes its greedy continuation g0, g1 (g2 next); sequence a prefills it and
    verifies [g0, g1, g2 + 1] (one draft accepted), then `accept`s. Both then hold the committed
    context prompt + [g0, g1], whose last row's pre-norm hidden the stash must hold. Returns the
    stash rows' max |Δ| over the plain row's max |value| (both sequences freed)."""
    a, c = engine.alloc_sequence(), engine.alloc_sequence()
    try:
        g0 = int(engine.prefill(c, prompt).argmax())
        g1 = int(engine.decode(c, g0).argmax())
        g2 = int(engine.decode(c, g1).argmax())
        engine.prefill(a, prompt)
        rows = [g0, g1, (g2 + 1) % engine.cfg.vocab_size]
        _, argmax = engine.verify_batched([a], rows, [3])
        assert list(argmax[:2]) == [g1, g2], "the verify's argmaxes are the greedy continuation"
        engine.accept([a], [1])
        stash = np.asarray(engine.pool.stash)
        plain = stash[c.slot].astype(np.float64)
        return float(np.abs(stash[a.slot] - plain).max() / np.abs(plain).max())
    finally:
        engine.free_sequence(c)
        engine.free_sequence(a)


#: Bugs of the classes the diff was blind to (issue 49), planted with `planted_coverage`: in the
#: prefix cache's host bookkeeping (instance methods of the engine's own `PrefixCache`), in the
#: swap record (`save_sequence_state`), in the scheduler's draft cut (`DraftSchedule.cut`, the
#: class: every schedule while planted), in the K ladder's slot capacity (the engine's
#: `PoolCounts.slot_draft_capacity`) or in the fused step's acceptance (its program compiled under
#: another name with `transitions.greedy_accepts` swapped while it traces). Every run on the engine
#: runs them while planted.
COVERAGE_MUTANTS = {
    "lru-keeps-referenced": "a cached block referenced again stays in the LRU (eviction frees a mapped block)",
    "keys-ignore-namespace": "the prefix cache's hash chain ignores the namespace",
    "swap-drops-partial-drafter-block": "a swap record holds one drafter block too few (its last, partial one)",
    "stop-keeps-one-below": "the confidence stop keeps the first draft below the stop",
    "tier-capacity": "a verify slot below the top tier admits one draft more than its verify rows hold",
    "sentinel": "the fused step's acceptance reads one column past a sequence's rows, the padding as token 0",
}


def colliding_accepts(tokens, argmax, lens):
    """The `sentinel` mutant's `greedy_accepts`: agreement counted up to column lens inclusive,
    with the padding read as token 0 (the sentinel before `inputs.PAD_TOKEN`): a full accept at
    K < K_max whose last row's argmax is 0 counts one draft more."""
    t = tokens.shape[1]
    tokens = jnp.where(tokens == PAD_TOKEN, 0, tokens)
    agree = (argmax[:, :-1] == tokens[:, 1:]) & (jnp.arange(1, t, dtype=jnp.int32)[None, :] <= lens[:, None])
    return jnp.sum(jnp.cumprod(agree.astype(jnp.int32), axis=1), axis=1, dtype=jnp.int32)


def _with_colliding_accepts(fn):
    @functools.wraps(fn)
    def traced(*args, **kw):
        # NOTE: the swap lasts while the program traces: the compiled program keeps it, nothing else sees it.
        kept, transitions.greedy_accepts = transitions.greedy_accepts, colliding_accepts
        try:
            return fn(*args, **kw)
        finally:
            transitions.greedy_accepts = kept

    return traced


def _one_more_draft(counts):
    capacity = counts.slot_draft_capacity

    def slot_draft_capacity(slot):
        cap = capacity(slot)
        return min(cap + 1, counts.k - 1) if cap else cap

    return slot_draft_capacity


def _acquire_keeps_lru(cache):
    def acquire(blocks):
        for b in blocks:
            cache._refs[b] += 1

    return acquire


@contextlib.contextmanager
def planted_coverage(engine, name: str):
    """Plant `COVERAGE_MUTANTS[name]` in `engine` (any `Engine`) for the block."""
    assert name in COVERAGE_MUTANTS, name
    prefix, save, cut = engine.blocks.prefix, engine.save_sequence_state, DraftSchedule.cut
    programs = getattr(engine, "programs", None)
    own_run = programs.__dict__.get("run") if programs is not None else None
    if name == "tier-capacity":
        object.__setattr__(engine.counts, "slot_draft_capacity", _one_more_draft(engine.counts))
    elif name == "sentinel":
        assert programs is not None
        run = programs.run

        def colliding_run(program, fn, static, *args):
            if program == "speculative_step":
                return run("speculative_step (sentinel mutant)", _with_colliding_accepts(fn), static, *args)
            return run(program, fn, static, *args)

        programs.run = colliding_run
    elif name == "stop-keeps-one-below":

        def keeps_one_below(self, drafts, confidences, keep):
            kept = cut(self, drafts, confidences, keep)[0]
            n = min(len(kept) + 1, keep)
            return [int(x) for x in drafts[:n]], [float(x) for x in confidences[:n]]

        DraftSchedule.cut = keeps_one_below  # type: ignore[method-assign]
    elif name == "lru-keeps-referenced":
        assert prefix is not None
        prefix.kv.acquire = _acquire_keeps_lru(prefix.kv)
    elif name == "keys-ignore-namespace":
        assert prefix is not None
        kv_keys, draft_keys = prefix.kv_keys, prefix.draft_keys
        prefix.kv_keys = lambda namespace, tokens: kv_keys("", tokens)
        prefix.draft_keys = lambda namespace, tokens: draft_keys("", tokens)
    else:

        def save_sequence_state(seq):
            record = save(seq)
            partial = record.drafter_len % engine.counts.draft_block_size
            return dataclasses.replace(record, draft_blocks=record.draft_blocks - bool(partial))

        engine.save_sequence_state = save_sequence_state
    try:
        yield
    finally:
        if prefix is not None:
            for owner, attr in ((prefix.kv, "acquire"), (prefix, "kv_keys"), (prefix, "draft_keys")):
                owner.__dict__.pop(attr, None)
        engine.__dict__.pop("save_sequence_state", None)
        DraftSchedule.cut = cut  # type: ignore[method-assign]
        if name == "tier-capacity":
            engine.counts.__dict__.pop("slot_draft_capacity", None)
        if name == "sentinel" and programs is not None:
            programs.__dict__.pop("run", None)
            if own_run is not None:
                programs.run = own_run
