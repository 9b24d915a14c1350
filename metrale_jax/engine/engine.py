"""`Engine`: the thin imperative shell over the pure transitions.

Owns: the device pool (replaced by each transition's output), the host bookkeeping (slots,
blocks, sequence lengths, tokens), shape bucketing, the selected forward, and the checks that
turn a bad request into an `EngineError` before anything changes.

Invariants:
- Every device-state change goes through one compiled transition with the pool donated; the
  host never edits device state.
- A refused request (capacity, exhaustion, misuse) leaves host and device state unchanged and
  leaks no slot or block.
- Widths are padded to `capacity.DECODE_BATCH_LADDER` and verify rows to K_max = num_drafts + 1
  per sequence, so one program per (transition, width bucket, forward) is compiled; K per
  sequence, slots and lengths are traced.
- Verify is always write-on-accept: after it, `gdn_fold_accepted` must see every verdict before
  `commit_accepted_prefix` runs; `accept` runs the whole verdict in that order (fold, rewind,
  commit, then the stash), as `speculative.speculative_generate`'s composed scheduler does.
- `speculative_step` is one scheduler step (verify, acceptance, verdict, propose) as one compiled
  program and one device-to-host transfer; it leaves no verify awaiting a verdict.
- Every device-to-host transfer goes through `_fetch`.
- Every program input is built by its `engine.inputs` constructor (padding rows included) and
  only its real rows are filled in here; every count and width comes from `capacity`.
- Prefix caching (`--enable-prefix-caching`, sequences allocated with a namespace): a fresh
  sequence's prefill restores the longest cached block-aligned prefix (snapshot copied into its
  slot, KV and drafter blocks shared read-only) and computes only the tail; a restored prefill is
  byte-identical to an uncached prefill split at the restore position. Snapshots are taken only
  at the end of prefill programs (committed state). The namespaced prefill also splits at the
  prompt's last full block and where it leaves the cached KV blocks (the branch point), so those
  positions are program ends and get snapshots.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from kernels_pallas.ops import Forward, Ops, PallasOps, ReferenceOps
from metrale_jax.config import ModelConfig
from metrale_jax.engine import transitions as tr
from metrale_jax.engine.capacity import bucket_width, draft_table_width, pool_counts
from metrale_jax.engine.inputs import (
    PrefillChunk,
    PrefillStatic,
    ProposeBatch,
    ProposeStatic,
    SequenceAddress,
    SnapshotCopy,
    SpeculativeStatic,
    StashBatch,
    StepBatch,
    StepStatic,
    SwapRecord,
    VerdictBatch,
)
from metrale_jax.engine.prefix_cache import Hit, PrefixCache
from metrale_jax.engine.program_list import Program, Sections, serve_programs, warm_up
from metrale_jax.engine.programs import ProgramCache
from metrale_jax.engine.sequences import BlockAllocator, EngineError, SequenceState, SlotAllocator
from metrale_jax.engine.settings import EngineSettings, unsupported
from metrale_jax.engine.sharding import (
    allocate_sharded_pool,
    canonical_pool,
    make_mesh,
    place_pool,
    shard_params,
    unshard_params,
)
from metrale_jax.model.backend_layout import backend_layout, checkpoint_layout
from metrale_jax.model.layout import arrange_layers

FORWARDS: tuple[str, ...] = get_args(Forward)
#: The prefix-cache namespace of a serve's sequences (`Engine.default_namespace`).
SERVE_NAMESPACE = "serve"


def make_ops(name: str) -> Ops:
    """The ops object of a forward: `xla` (jnp reference twins) or `pallas` (kernels)."""
    if name == "xla":
        return ReferenceOps()
    if name == "pallas":
        return PallasOps()
    raise EngineError(f"unknown forward {name!r} (choose from {', '.join(FORWARDS)})")


@dataclasses.dataclass(frozen=True)
class Verified:
    """A verify awaiting its verdict, per sequence: the rows verified, the seq_len before them,
    its first flat row in that verify and which verify it was (the engine's count)."""

    rows: list[int]
    before: int
    row0: int
    serial: int


@dataclasses.dataclass(frozen=True)
class SpeculativeOutput:
    """A fused speculative step's outcome for its n sequences (host numpy): accepted [n] drafts
    accepted, emitted (per sequence its accepted + 1 tokens, the verify's argmaxes), drafts [n, nd]
    int32 and confidences [n, nd] f32 of the next propose (nd = 0: none); with logits asked for,
    verify_logits [R, V] f32 (R = sum K) and draft_logits [n, V] f32 (nd > 0), else None."""

    accepted: np.ndarray
    emitted: list[list[int]]
    drafts: np.ndarray
    confidences: np.ndarray
    verify_logits: np.ndarray | None = None
    draft_logits: np.ndarray | None = None


def _place_params(params, cfg: ModelConfig, mesh: Mesh | None):
    """The engine's weights: sharded over `mesh`, or on the default device in this backend's layout
    (`backend_layout`: on XLA CPU input-major, experts one leaf each where that applies)."""
    return backend_layout(params, cfg, mesh) if mesh is None else shard_params(params, cfg, mesh)


class Engine:
    """Host shell of the engine. See the module docstring for the invariants."""

    def __init__(
        self,
        cfg: ModelConfig,
        params,
        settings: EngineSettings,
        *,
        forward: str = "xla",
        layout: str = "list",
        mesh: Mesh | None = None,
    ):
        """mesh: the (ep, tp) device mesh (`sharding.make_mesh`) the weights and the pool are sharded
        over (`sharding.shard_params`, `allocate_sharded_pool`); None: the mesh of the settings'
        --tensor/--expert-parallel-size (1 x 1: the default device)."""
        refused = unsupported(settings, cfg)
        if refused:
            raise EngineError("not supported: " + "; ".join(refused))
        self.cfg = cfg
        if mesh is None:
            mesh = make_mesh(cfg, settings.tensor_parallel_size, settings.expert_parallel_size)
        self.mesh = mesh
        self.params = _place_params(arrange_layers(params, cfg, layout), cfg, mesh)
        self.settings = settings
        self.dtype = params["embed"].dtype
        self.counts = pool_counts(settings, cfg)
        self.pool = allocate_sharded_pool(cfg, self.counts, settings, dtype=self.dtype, mesh=mesh)
        self.drafter = self.counts.drafter
        self.slots = SlotAllocator(self.counts.real_slots)
        self.blocks = BlockAllocator(self.counts.kv_blocks - 1, "KV blocks")
        self.draft_blocks = BlockAllocator(max(self.counts.draft_kv_blocks - 1, 0), "drafter KV blocks")
        self.programs = ProgramCache()
        self._program_caches = {mesh: self.programs}  # per mesh: programs are compiled for one placement
        self.forward = forward
        self.ops = make_ops(forward)
        self._next_id = 0
        self._verify_hidden = None  # hidden rows of the last verify (device)
        self.replay = settings.ssm_rollback_mode == "replay"
        self._verifies = 0  # verifies run (`Verified.serial`)
        self._verified: dict[int, Verified] = {}  # seq_id -> its verify, until its verdict is committed
        self.draft_width = draft_table_width(settings.max_seq_len)  # MBd, the drafter tables' width
        c = self.counts
        self.prefix = (
            PrefixCache(c.block_size, c.draft_block_size, c.snapshot_slots, self.drafter)
            if settings.enable_prefix_caching
            else None
        )
        # the namespace of sequences allocated without one (None: uncached)
        self.default_namespace: str | None = SERVE_NAMESPACE if self.prefix is not None else None

    # ------------------------------------------------------------ forward selection

    def set_forward(self, name: str) -> None:
        """Select the forward used from the next transition on (the model code is untouched)."""
        self.ops = make_ops(name)
        self.forward = name

    def set_mesh(self, mesh: Mesh | None) -> None:
        """Reshard the weights and the pool over `mesh` (None: the default device); the host
        bookkeeping and every sequence's state are unchanged, programs are cached per mesh.
        Refused (EngineError) while a verify awaits its verdict."""
        if self._verified:
            raise EngineError("set_mesh with a verify awaiting its verdict")
        params = unshard_params(checkpoint_layout(self.params), self.cfg, self.mesh)
        pool = canonical_pool(self.pool, self.cfg, self.mesh)
        self.params = _place_params(params, self.cfg, mesh)
        self.pool = place_pool(pool, self.cfg, mesh)
        self.mesh = mesh
        self.programs = self._program_caches.setdefault(mesh, ProgramCache())

    def disclosure(self, name: str | None = None, mesh: Mesh | None = None) -> dict:
        """What a forward compiled (plan digest, launches per step, per-program digests) on `mesh`
        (default: the current one) and, for a kernel forward, the shapes its kernels refused (run
        by the reference instead)."""
        name = name or self.forward
        cache = self.programs if mesh is None else self._program_caches.get(mesh, ProgramCache())
        out = cache.disclosure(name)
        ops = make_ops(name)
        out["refusals"] = list(ops.refusals()) if hasattr(ops, "refusals") else []
        return out

    # ------------------------------------------------------------ sequences

    def alloc_sequence(self, namespace: str | None = None) -> SequenceState:
        """A fresh sequence on the lowest free slot; `namespace`: its prefix-cache namespace
        (needs --enable-prefix-caching; None: `default_namespace`, and with that None too, its
        prefills neither restore nor cache)."""
        if namespace is not None and self.prefix is None:
            raise EngineError("a prefix-cache namespace needs --enable-prefix-caching")
        namespace = self.default_namespace if namespace is None else namespace
        slot = self.slots.alloc()
        seq = SequenceState(seq_id=self._next_id, slot=slot, namespace=namespace)
        self._next_id += 1
        return seq

    def free_sequence(self, seq: SequenceState) -> None:
        if seq.freed:
            raise EngineError(f"sequence {seq.seq_id} was already freed")
        self.slots.free(seq.slot)
        self._release_blocks(seq.blocks, seq.draft_blocks)
        seq.blocks, seq.draft_blocks, seq.freed = [], [], True

    def _release_blocks(self, blocks: list[int], draft_blocks: list[int]) -> None:
        """Give back a sequence's blocks: cached ones lose a reference, the rest are freed."""
        if self.prefix is not None:
            blocks, draft_blocks = self.prefix.kv.release(blocks), self.prefix.draft.release(draft_blocks)
        self.blocks.free_many(blocks)
        self.draft_blocks.free_many(draft_blocks)

    def _reserve(self, seqs: Sequence[SequenceState], upto: Sequence[int], held: tuple[int, int] | None = None) -> None:
        """Give each sequence KV blocks (and drafter blocks) for positions < upto[i]; all or none.
        `held`: instead, exactly this many (KV, drafter) blocks each (a swap-in restores the count
        it saved). Refuses (EngineError, nothing changed) a sequence given twice, freed, not
        allocated by this engine, past --max-seq-len, or more blocks than are free."""
        bs, dbs = self.counts.block_size, self.counts.draft_block_size
        ids = [s.seq_id for s in seqs]
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice or len({s.slot for s in seqs}) < len(seqs):
            raise EngineError(f"sequence(s) {twice or ids} given twice (or sharing a slot) in one batch")
        for s, u in zip(seqs, upto):
            if s.freed:
                raise EngineError(f"sequence {s.seq_id} was freed")
            if not (0 <= s.seq_id < self._next_id and 0 <= s.slot < self.counts.real_slots):
                raise EngineError(f"sequence {s.seq_id} (slot {s.slot}) was not allocated by this engine")
            if u > self.settings.max_seq_len:
                raise EngineError(
                    f"sequence {s.seq_id} would reach {u} tokens, over --max-seq-len {self.settings.max_seq_len}"
                )
        if held is None:
            need = [max(0, math.ceil(u / bs) - len(s.blocks)) for s, u in zip(seqs, upto)]
            dneed = [
                max(0, math.ceil(u / dbs) - len(s.draft_blocks)) if self.drafter else 0 for s, u in zip(seqs, upto)
            ]
        else:
            most = (math.ceil(self.settings.max_seq_len / bs), math.ceil(self.settings.max_seq_len / dbs))
            if held[0] > most[0] or held[1] > (most[1] if self.drafter else 0):
                raise EngineError(f"{held} (KV, drafter) blocks per sequence exceed this engine's {most}")
            need = [max(0, held[0] - len(s.blocks)) for s in seqs]
            dneed = [max(0, held[1] - len(s.draft_blocks)) for s in seqs]
        self._make_room(sum(need), sum(dneed))
        if sum(need) > self.blocks.free_count:
            raise EngineError(f"KV blocks exhausted: {sum(need)} needed, {self.blocks.free_count} free")
        if sum(dneed) > self.draft_blocks.free_count:
            raise EngineError(f"drafter KV blocks exhausted: {sum(dneed)} needed, {self.draft_blocks.free_count} free")
        for s, n, dn in zip(seqs, need, dneed):
            s.blocks += self.blocks.alloc_many(n)
            s.draft_blocks += self.draft_blocks.alloc_many(dn)

    def _make_room(self, need: int, dneed: int) -> None:
        """Evict least recently used unreferenced cached blocks so that `need` KV and `dneed`
        drafter blocks are free, only when that suffices for both (else nothing changes)."""
        if self.prefix is None:
            return
        short = max(0, need - self.blocks.free_count), max(0, dneed - self.draft_blocks.free_count)
        if short[0] > self.prefix.kv.evictable or short[1] > self.prefix.draft.evictable:
            return
        self.blocks.free_many(self.prefix.kv.evict(short[0]))
        self.draft_blocks.free_many(self.prefix.draft.evict(short[1]))

    @staticmethod
    def _set_tables(block_tables: np.ndarray, draft_tables: np.ndarray, i: int, seq: SequenceState) -> None:
        """Write row i of a batch's (null-filled) block and drafter tables from `seq`'s blocks."""
        block_tables[i, : len(seq.blocks)] = seq.blocks
        draft_tables[i, : len(seq.draft_blocks)] = seq.draft_blocks

    # ------------------------------------------------------------ prefill / decode

    def prefill(self, seq: SequenceState, tokens: Sequence[int], chunk: int | None = None) -> np.ndarray:
        """Prefill `tokens` (appended after the sequence's cache) in chunks of at most
        `chunk` (default: the serve's prefill chunk). Returns the last position's logits [V] f32.
        A namespaced fresh sequence first restores the longest cached prefix (`seq.restored_at`,
        0 when it computed everything); a namespaced prefill caches its full blocks and takes a
        snapshot at every block-aligned program end (module docstring)."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise EngineError("prefill of zero tokens")
        self._check_tokens(tokens)
        chunk = min(chunk or self.counts.prefill_chunk, self.counts.prefill_chunk)
        cached = self.prefix is not None and seq.namespace is not None
        fresh = not (seq.seq_len or seq.blocks or seq.draft_blocks)
        hit, branch = None, 0
        if self.prefix is not None and seq.namespace is not None and fresh:
            hit = self.prefix.longest(seq.namespace, tokens)
            branch = self.prefix.kv_depth(seq.namespace, tokens[:-1]) * self.counts.block_size
        if hit is not None:
            self._map_prefix(seq, hit, tokens)
            tokens = tokens[hit.snapshot.position :]
        else:
            self._reserve([seq], [seq.seq_len + len(tokens) + 1])
        if fresh:
            seq.restored_at = hit.snapshot.position if hit is not None else 0
        static = PrefillStatic(self.cfg, self.counts, self.ops, drafter=self.drafter)
        for off, end in self._prefill_bounds(seq.seq_len, len(tokens), chunk, cached, branch):
            part = tokens[off:end]
            x = PrefillChunk.padded(self.counts, self.draft_width, self.counts.prefill_bucket(len(part)))
            x.tokens[0, : len(part)] = part
            x.start[0], x.length[0], x.slot[0] = seq.seq_len, len(part), seq.slot
            self._set_tables(x.block_table, x.draft_table, 0, seq)
            logits, self.pool = self.programs.run("prefill_chunk", tr.prefill_chunk, static, self.pool, self.params, x)
            seq.seq_len += len(part)
            seq.tokens += part
            if cached:
                self._cache_prefix(seq)
        seq.drafter_len = seq.seq_len - 1
        return self._fetch(logits)[0]

    def _prefill_bounds(self, start: int, n: int, chunk: int, cached: bool, branch: int = 0) -> list[tuple[int, int]]:
        """The (offset, end) into the n tokens of a prefill starting at `start` of each program:
        chunks of `chunk`, and with `cached` more splits at the last full block and at `branch`
        (where the prompt leaves the cached KV blocks: a snapshot there serves the next prompt
        sharing that prefix)."""
        cuts = set(range(chunk, n, chunk))
        full = (start + n) // self.counts.block_size * self.counts.block_size
        for at in (full - start, branch - start) if cached else ():
            if 0 < at < n:
                cuts.add(at)
        edges = [0, *sorted(cuts), n]
        return list(zip(edges[:-1], edges[1:]))

    def _map_prefix(self, seq: SequenceState, hit: Hit, tokens: list[int]) -> None:
        """Restore `hit` (a prefix of `tokens`) into fresh `seq`: share its blocks, reserve the
        rest for the whole prompt (all or nothing: a refusal gives the shared blocks back), then
        copy the snapshot (state, stash, partial drafter block) into the sequence's slot and its
        own drafter block."""
        assert self.prefix is not None
        p = hit.snapshot.position
        self.prefix.kv.acquire(hit.blocks)
        self.prefix.draft.acquire(hit.draft_blocks)
        seq.blocks, seq.draft_blocks = list(hit.blocks), list(hit.draft_blocks)
        try:
            self._reserve([seq], [len(tokens) + 1])
        except EngineError:
            self._release_blocks(seq.blocks, seq.draft_blocks)
            seq.blocks, seq.draft_blocks = [], []
            raise
        x = self._snapshot_copy(seq, hit.snapshot.slot, p)
        self.pool = self.programs.run("restore_snapshot", tr.restore_snapshot, None, self.pool, x)
        seq.seq_len, seq.tokens, seq.shared_len, seq.drafter_len = p, tokens[:p], p, p - 1

    def _cache_prefix(self, seq: SequenceState) -> None:
        """After a prefill program of namespaced `seq`: cache its full KV blocks and the drafter
        blocks whose pairs are all committed, and at a block-aligned length take a snapshot into a
        slot the snapshot LRU gives (none: no slots, or that prefix has one already)."""
        assert self.prefix is not None and seq.namespace is not None
        ns, n = seq.namespace, seq.seq_len
        keys = self.prefix.kv_keys(ns, seq.tokens)
        for key, block in zip(keys, seq.blocks):
            self.prefix.kv.register(key, block)
        if self.drafter:
            for key, block in zip(self.prefix.draft_keys(ns, seq.tokens), seq.draft_blocks):
                self.prefix.draft.register(key, block)
        seq.shared_len = max(seq.shared_len, len(keys) * self.counts.block_size)
        if n % self.counts.block_size or not keys:
            return
        snap = self.prefix.snapshots.claim(keys[-1], n)
        if snap is None:
            return
        x = self._snapshot_copy(seq, snap.slot, n)
        self.pool = self.programs.run("take_snapshot", tr.take_snapshot, None, self.pool, x)

    def _snapshot_copy(self, seq: SequenceState, snap_slot: int, position: int) -> SnapshotCopy:
        """The input of a snapshot copy between `seq`'s slot and snapshot slot `snap_slot` at
        `position` tokens: with a drafter, the drafter block holding position - 1 (the partial
        block the snapshot carries)."""
        x = SnapshotCopy.padded(self.counts)
        x.slot[...], x.snap[...] = seq.slot, snap_slot
        if self.drafter:
            x.draft_block[...] = seq.draft_blocks[(position - 1) // self.counts.draft_block_size]
        return x

    @staticmethod
    def _fetch(x: jax.Array) -> np.ndarray:
        """The engine's one device-to-host transfer point: `x` as numpy."""
        return np.asarray(x)

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        bad = [t for t in tokens if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise EngineError(f"token(s) {bad[:5]} outside the vocabulary 0..{self.cfg.vocab_size - 1}")

    def _step_batch(
        self,
        seqs: Sequence[SequenceState],
        tokens_per_seq: Sequence[Sequence[int]],
        verify: bool,
        starts: Sequence[int] | None = None,
    ) -> tuple[StepBatch, int]:
        """The `StepBatch` of seqs' ragged rows at positions starts[i].. (default: their lengths),
        flat rows compacted seq-major; returns (batch, R = the real rows)."""
        n = len(seqs)
        if n == 0:
            raise EngineError("a step over zero sequences")
        t = self.counts.k if verify else 1
        batch = StepBatch.padded(self.counts, self.draft_width, bucket_width(n), t, verify=verify)
        r = 0
        for i, (s, rows) in enumerate(zip(seqs, tokens_per_seq)):
            batch.tokens[i, : len(rows)] = rows
            batch.lens[i] = len(rows)
            batch.seq_lens[i] = s.seq_len if starts is None else starts[i]
            batch.slots[i] = s.slot
            if verify:
                batch.vrow_base[i] = self.counts.verify_row_base(s.slot)
                batch.vslot[i] = self.counts.verify_slot(s.slot)
            batch.row_index[r : r + len(rows)] = i * t + np.arange(len(rows))
            self._set_tables(batch.block_tables, batch.draft_tables, i, s)
            r += len(rows)
        return batch, r

    def _rows(
        self,
        seqs: Sequence[SequenceState],
        tokens_per_seq: Sequence[Sequence[int]],
        verify: bool,
        starts: Sequence[int] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Run `step_rows` for seqs with ragged rows at positions starts[i].. (default: their
        lengths, which then grow by the rows); returns (logits [R, V], argmax [R]) numpy."""
        batch, r = self._step_batch(seqs, tokens_per_seq, verify, starts)
        static = StepStatic(self.cfg, self.counts, self.ops, verify=verify, drafter=self.drafter)
        logits, argmax, hidden, self.pool = self.programs.run(
            "step_rows", tr.step_rows, static, self.pool, self.params, batch
        )
        if starts is None:
            if verify:
                self._verify_hidden = hidden
            for s, rows in zip(seqs, tokens_per_seq):
                s.seq_len += len(rows)
                s.tokens += [int(x) for x in rows]
        return self._fetch(logits)[:r], self._fetch(argmax)[:r]

    def decode_batch(self, seqs: Sequence[SequenceState], tokens: Sequence[int]) -> np.ndarray:
        """One token per sequence. Returns logits [n, V] f32."""
        if len(tokens) != len(seqs):
            raise EngineError(f"{len(tokens)} tokens for {len(seqs)} sequences")
        self._check_tokens(tokens)
        self._reserve(seqs, [s.seq_len + 1 for s in seqs])
        logits, _ = self._rows(seqs, [[int(t)] for t in tokens], verify=False)
        for s in seqs:
            s.drafter_len = s.seq_len - 1
        return logits

    def decode(self, seq: SequenceState, token: int) -> np.ndarray:
        return self.decode_batch([seq], [token])[0]

    # ------------------------------------------------------------ speculative verify

    def can_batch_verify(self, seqs: Sequence[SequenceState], ks: Sequence[int]) -> str | None:
        """Why a batched verify of `ks` over `seqs` is refused, or None."""
        if not self.counts.speculative:
            return "verify needs a speculative serve (--speculative)"
        if len(ks) != len(seqs):
            return f"{len(ks)} widths for {len(seqs)} sequences"
        for s, k in zip(seqs, ks):
            cap = self.counts.slot_draft_capacity(s.slot)
            if not 1 <= k <= cap + 1:
                return f"sequence {s.seq_id} (slot {s.slot}) cannot verify K={k}: its slot holds {cap} draft row(s)"
        return None

    def verify_batched(self, seqs: Sequence[SequenceState], tokens: Sequence[int], ks: Sequence[int]):
        """Batched verify with write-on-accept. tokens: flat seq-major rows, sequence i's rows
        [last_i, d_1 .. d_{K_i-1}]. On success each sequence gains K_i tokens. Returns
        (logits [R, V] f32, argmax [R] int32) with R = sum(ks)."""
        reason = self.can_batch_verify(seqs, ks)
        if reason:
            raise EngineError(reason)
        if len(tokens) != sum(ks):
            raise EngineError(f"{len(tokens)} tokens for ks summing to {sum(ks)}")
        self._check_tokens(tokens)
        self._reserve(seqs, [s.seq_len + k + 1 for s, k in zip(seqs, ks)])
        off = np.concatenate([[0], np.cumsum(ks)])
        rows = [[int(t) for t in tokens[off[i] : off[i + 1]]] for i in range(len(seqs))]
        before = [s.seq_len for s in seqs]
        out = self._rows(seqs, rows, verify=True)
        self._verifies += 1
        self._verified.update(
            {s.seq_id: Verified(r, b, int(o), self._verifies) for s, r, b, o in zip(seqs, rows, before, off)}
        )
        return out

    def accept(self, seqs: Sequence[SequenceState], accepted: Sequence[int]) -> None:
        """The verdict of seqs' last `verify_batched`: accepted[i] of sequence i's drafts (its
        leading drafts the verify's argmax agreed with) are kept. In order: the GDN fold; the host
        rewind of the rejected rows; the commit of rows 0..accepted[i]; with the drafter, the
        accepted rows' hiddens stashed (the seqs must all come from the engine's last verify)."""
        missing = [s.seq_id for s in seqs if s.seq_id not in self._verified]
        if missing:
            raise EngineError(f"sequence(s) {missing} have no verify awaiting a verdict")
        if len(accepted) != len(seqs):
            raise EngineError(f"{len(accepted)} verdicts for {len(seqs)} sequences")
        verified = [self._verified[s.seq_id] for s in seqs]
        for s, v, a in zip(seqs, verified, accepted):
            if not 0 <= a < len(v.rows):
                raise EngineError(f"sequence {s.seq_id}: {a} accepted drafts of a K={len(v.rows)} verify")
        if self.drafter:
            stale = [s.seq_id for s, v in zip(seqs, verified) if v.serial != self._verifies]
            if stale:
                raise EngineError(
                    f"sequence(s) {stale}: another verify ran since theirs (accept before verifying again)"
                )
        rows, ks = [a + 1 for a in accepted], [len(v.rows) for v in verified]
        self.gdn_fold_accepted(seqs, rows, ks)
        for s, r, k in zip(seqs, rows, ks):
            self.rewind(s, k - r)
        self.commit_accepted_prefixes(seqs, rows, ks)
        if self.drafter:
            # NOTE: after the commit: replay rollback's commit re-runs the accepted rows, whose drafter
            # catch-up pairs row 0 with the stash, which must still hold the pre-verify hidden.
            self.stash_verify_hidden_rows(seqs, [v.row0 + a for v, a in zip(verified, accepted)])
        for s in seqs:
            s.drafter_len = s.seq_len - 1

    def speculative_step(
        self,
        seqs: Sequence[SequenceState],
        tokens: Sequence[int],
        ks: Sequence[int],
        num_drafts: int,
        *,
        logits: bool = False,
    ) -> SpeculativeOutput:
        """One scheduler step as one program (`transitions.speculative_step`): the write-on-accept
        verify of `tokens` (flat seq-major rows, sequence i's `[last_i, d_1 .. d_{K_i - 1}]`),
        greedy acceptance on the device, the verdict, and a propose of `num_drafts` drafts (0:
        none) from each committed context. One compiled-program call and one device-to-host
        transfer (`logits`: the verify's and the propose's logits too, two more). Each sequence
        gains its accepted drafts + 1 tokens, as `verify_batched` then `accept` leave it (a
        propose then trims back to the committed context). KV and drafter blocks are reserved up
        front for seq_len + K_i + num_drafts + 1 positions. Snapshot rollback only (replay
        rollback runs the composed step)."""
        if self.replay:
            raise EngineError("the fused speculative step needs --ssm-rollback-mode snapshot")
        reason = self.can_batch_verify(seqs, ks)
        if reason:
            raise EngineError(reason)
        if not 0 <= num_drafts <= (self.settings.num_drafts if self.drafter else 0):
            raise EngineError(f"num_drafts {num_drafts} outside 0..{self.settings.num_drafts if self.drafter else 0}")
        if len(tokens) != sum(ks):
            raise EngineError(f"{len(tokens)} tokens for ks summing to {sum(ks)}")
        pending = [s.seq_id for s in seqs if s.seq_id in self._verified]
        if pending:
            raise EngineError(f"sequence(s) {pending} have a verify awaiting its verdict (Engine.accept)")
        self._check_tokens(tokens)
        self._reserve(seqs, [s.seq_len + k + num_drafts + 1 for s, k in zip(seqs, ks)])
        off = np.concatenate([[0], np.cumsum(ks)])
        rows = [[int(t) for t in tokens[off[i] : off[i + 1]]] for i in range(len(seqs))]
        batch, r = self._step_batch(seqs, rows, verify=True)
        static = SpeculativeStatic(
            self.cfg, self.counts, self.ops, drafter=self.drafter, num_drafts=num_drafts, logits=logits
        )
        packed, extras, self.pool = self.programs.run(
            "speculative_step", tr.speculative_step, static, self.pool, self.params, batch
        )
        n, t = len(seqs), self.counts.k
        out = self._fetch(packed)[:n]
        accepted = out[:, 0]
        for s, row, a in zip(seqs, rows, accepted.tolist()):
            s.seq_len += a + 1
            s.tokens += row[: a + 1]
            s.drafter_len = s.seq_len if num_drafts else s.seq_len - 1
            s.last_num_drafted = 0
        fetched = [self._fetch(x) for x in extras]
        return SpeculativeOutput(
            accepted=accepted,
            emitted=[g[: a + 1] for g, a in zip(out[:, 1 : 1 + t].tolist(), accepted.tolist())],
            drafts=out[:, 1 + t : 1 + t + num_drafts],
            confidences=np.ascontiguousarray(out[:, 1 + t + num_drafts :]).view(np.float32),
            verify_logits=fetched[0][:r] if fetched else None,
            draft_logits=fetched[1][:n] if len(fetched) > 1 else None,
        )

    def _verdicts(self, seqs: Sequence[SequenceState], rows: Sequence[int], ks: Sequence[int]) -> VerdictBatch:
        """The `VerdictBatch` of `seqs`' verdicts (rows kept of ks verified)."""
        v = VerdictBatch.padded(self.counts, bucket_width(len(seqs)))
        for i, (s, r, k) in enumerate(zip(seqs, rows, ks)):
            v.slots[i], v.vslots[i], v.rows[i], v.ks[i] = s.slot, self.counts.verify_slot(s.slot), r, k
            v.vrow_base[i] = self.counts.verify_row_base(s.slot)
        return v

    def gdn_fold_accepted(self, seqs: Sequence[SequenceState], rows: Sequence[int], ks: Sequence[int]) -> None:
        """Fold every sequence's verdict into its live GDN state: rows = accepted drafts + 1.
        Snapshot rollback copies the accepted row's state; replay rollback puts the pre-verify
        state back (the commit then replays the accepted rows)."""
        self._check_rows(seqs, rows, ks)
        if self.replay:
            self._restore(seqs, [r < k for r, k in zip(rows, ks)])
            return
        verdicts = self._verdicts(seqs, rows, ks)
        self.pool = self.programs.run("gdn_fold", tr.gdn_fold_accepted, None, self.pool, verdicts)

    def _restore(self, seqs: Sequence[SequenceState], mask: Sequence[bool]) -> None:
        """Put back the pre-verify GDN state of seqs[i] where mask[i]."""
        v = self._verdicts(seqs, [1] * len(seqs), [1] * len(seqs))
        v.restore[: len(seqs)] = mask
        self.pool = self.programs.run("restore_ckpt", tr.restore_checkpoint, None, self.pool, v)

    def rollback_verify(self, seqs: Sequence[SequenceState]) -> None:
        """Abandon the last verify of `seqs`: live GDN state, length and tokens as before it (its
        KV rows lie past the length and are overwritten before they are read)."""
        missing = [s.seq_id for s in seqs if s.seq_id not in self._verified]
        if missing:
            raise EngineError(f"sequence(s) {missing} have no verify to roll back")
        self._restore(seqs, [True] * len(seqs))
        for s in seqs:
            self.rewind(s, s.seq_len - self._verified.pop(s.seq_id).before)

    def commit_accepted_prefixes(self, seqs: Sequence[SequenceState], rows: Sequence[int], ks: Sequence[int]) -> None:
        """Roll each sequence's conv window back to its last accepted row (rows < K); under
        replay rollback, re-run the accepted rows from the restored pre-verify state instead
        (same program shape as the verify, so the state and KV come out bit-identical)."""
        self._check_rows(seqs, rows, ks)
        verified = [self._verified.pop(s.seq_id, None) for s in seqs]
        if self.replay:
            redo = [
                (s, v.rows[:r], v.before) for s, v, r, k in zip(seqs, verified, rows, ks) if v is not None and r < k
            ]
            if redo:
                self._rows([x[0] for x in redo], [x[1] for x in redo], verify=True, starts=[x[2] for x in redo])
            return
        verdicts = self._verdicts(seqs, rows, ks)
        self.pool = self.programs.run("commit_conv", tr.commit_conv, None, self.pool, verdicts)

    def commit_accepted_prefix(self, seq: SequenceState, rows: int, k: int) -> None:
        """`commit_accepted_prefixes` of one sequence (rows == K is a no-op)."""
        self.commit_accepted_prefixes([seq], [rows], [k])

    @staticmethod
    def _check_rows(seqs: Sequence[SequenceState], rows: Sequence[int], ks: Sequence[int]) -> None:
        if not len(seqs) == len(rows) == len(ks):
            raise EngineError("seqs, rows and ks differ in length")
        for s, r, k in zip(seqs, rows, ks):
            if not 1 <= r <= k:
                raise EngineError(f"sequence {s.seq_id}: {r} committed rows of a K={k} verify (must be 1..K)")

    @staticmethod
    def rewind(seq: SequenceState, rejected: int) -> None:
        """Host-side rewind of `rejected` trailing verify rows (their KV is left in place and
        overwritten before it is ever read)."""
        if not 0 <= rejected <= seq.seq_len:
            raise EngineError(f"cannot rewind {rejected} rows of sequence {seq.seq_id}")
        if seq.seq_len - rejected < seq.shared_len:
            raise EngineError(
                f"cannot rewind sequence {seq.seq_id} below {seq.shared_len}: those positions are in shared "
                "prefix-cache blocks"
            )
        seq.seq_len -= rejected
        del seq.tokens[len(seq.tokens) - rejected :]

    def stash_verify_hidden_rows(self, seqs: Sequence[SequenceState], rows: Sequence[int]) -> None:
        """Stash the pre-norm hidden of flat verify row rows[i] for seqs[i] (its accepted row)."""
        if self._verify_hidden is None:
            raise EngineError("no verify to stash hidden rows from")
        if not self.drafter:
            raise EngineError("no MTP drafter to stash hidden rows for")
        x = StashBatch.padded(self.counts, bucket_width(len(seqs)))
        for i, (s, r) in enumerate(zip(seqs, rows)):
            x.rows[i], x.slots[i] = r, s.slot
        self.pool = self.programs.run("stash_rows", tr.stash_hidden_rows, None, self.pool, self._verify_hidden, x)

    # ------------------------------------------------------------ MTP drafter

    def propose_batched(self, seqs: Sequence[SequenceState], last: Sequence[int], num_drafts: int):
        """Batched MTP propose. Returns (drafts [n, nd] int32, confidences [n, nd] f32, logits of
        the last draft position [n, V] f32), numpy."""
        if not self.drafter:
            raise EngineError("no MTP drafter (needs --speculative and a checkpoint with MTP layers)")
        if not 1 <= num_drafts <= self.settings.num_drafts:
            raise EngineError(f"num_drafts {num_drafts} outside 1..{self.settings.num_drafts}")
        self._reserve(seqs, [s.seq_len + num_drafts + 1 for s in seqs])
        n = len(seqs)
        x = ProposeBatch.padded(self.counts, self.draft_width, bucket_width(n))
        for i, (s, tok) in enumerate(zip(seqs, last)):
            x.last[i], x.seq_lens[i], x.slots[i], x.valid[i] = tok, s.seq_len, s.slot, True
            x.draft_tables[i, : len(s.draft_blocks)] = s.draft_blocks
        static = ProposeStatic(self.cfg, self.counts, self.ops, num_drafts=num_drafts)
        drafts, conf, logits, self.pool = self.programs.run("propose", tr.propose, static, self.pool, self.params, x)
        for s in seqs:
            s.last_num_drafted = num_drafts
            s.drafter_len = s.seq_len + num_drafts - 1
        return self._fetch(drafts)[:n], self._fetch(conf)[:n], self._fetch(logits)[:n]

    def trim_proposer(self, seq: SequenceState, keep: int = 0) -> None:
        """Forget the drafter rows a propose chained past the committed context, keeping `keep`.
        Host-only: the drafter KV past the context is overwritten before it is read."""
        seq.drafter_len = min(seq.drafter_len, seq.seq_len + keep)
        seq.last_num_drafted = 0

    # ------------------------------------------------------------ swap

    def _address(self, seq: SequenceState) -> SequenceAddress:
        """Where `seq`'s state lives (slot, null-padded block tables)."""
        at = SequenceAddress.padded(self.counts, self.draft_width)
        at.slot[...] = seq.slot
        at.blocks[: len(seq.blocks)] = seq.blocks
        at.draft_blocks[: len(seq.draft_blocks)] = seq.draft_blocks
        return at

    def save_sequence_state(self, seq: SequenceState) -> SwapRecord:
        """Swap-out record: numpy copies of everything the sequence owns on device, plus host facts."""
        arrays, self.pool = self.programs.run("read_state", tr.read_sequence_state, None, self.pool, self._address(seq))
        return SwapRecord(
            device=jax.tree_util.tree_map(self._fetch, arrays),
            seq_len=seq.seq_len,
            tokens=tuple(seq.tokens),
            blocks=len(seq.blocks),
            draft_blocks=len(seq.draft_blocks),
            drafter_len=seq.drafter_len,
        )

    def restore_sequence_state(self, seq: SequenceState, record: SwapRecord) -> None:
        """Swap-in `record` into a freshly allocated sequence (its own slot and new blocks)."""
        if seq.seq_len or seq.blocks or seq.draft_blocks:
            raise EngineError("restore needs a freshly allocated sequence")
        self._reserve([seq], [record.seq_len], held=(record.blocks, record.draft_blocks))
        dev = jax.tree_util.tree_map(jnp.asarray, record.device)
        self.pool = self.programs.run("write_state", tr.write_sequence_state, None, self.pool, dev, self._address(seq))
        seq.seq_len, seq.tokens, seq.drafter_len = record.seq_len, list(record.tokens), record.drafter_len

    # ------------------------------------------------------------ warm-up

    def warm_up(
        self, progress: Sections | None = None, keep: Callable[[Program], bool] | None = None, *, logits: bool = False
    ) -> float:
        """Compile ahead of time every program this serve runs on the current forward and mesh
        (`program_list.serve_programs`, with `logits` the fused step's logits twins; `keep`: only
        those it keeps), so that no step compiles. Returns the wall seconds."""
        programs = serve_programs(self.cfg, self.counts, self.settings, self.ops, self.pool, self.params, logits=logits)
        chosen = [p for p in programs if (keep is None or keep(p)) and not (self.mesh is not None and p.device_inputs)]
        return warm_up(self.programs, chosen, progress, f"warm-up ({self.forward})")
