"""`Engine`: the thin imperative shell over the pure transitions.

Owns: the device pool (replaced by each transition's output), the weights, the selected forward,
the host-side sequence lengths and tokens, and the checks that turn a bad request into an
`EngineError` before anything changes. The rest is delegated, each part to its own module:
slots, blocks, reservations and the prefix cache's bookkeeping to the block manager
(`Engine.blocks`, an `engine.blocks.BlockManager`); each program's input to batch assembly
(`engine.batching`); the verdict after a verify to the verdict protocol (`engine.verdict`, the
engine's base class); where the weights and the pool live to `engine.placement`.

Invariants:
- Every device-state change goes through one compiled transition with the pool donated; the
  host never edits device state.
- A refused request (capacity, exhaustion, misuse) leaves host and device state unchanged and
  leaks no slot or block.
- Widths are padded to `capacity.DECODE_BATCH_LADDER` and verify rows to K_max = num_drafts + 1
  per sequence, so one program per (transition, width bucket, forward) is compiled; K per
  sequence, slots and lengths are traced.
- Verify is always write-on-accept: a verify awaits its verdict (`accept` or `rollback_verify`,
  `engine.verdict`) before the sequence's next step.
- `speculative_step` is one scheduler step (verify, acceptance, verdict, propose) as one compiled
  program and one device-to-host transfer; it leaves no verify awaiting a verdict.
- Every device-to-host transfer goes through `_fetch`.
- Token selection: a call given `sampling` (one `engine.sampling.Sampling` per sequence) runs the
  sampling twin of its program (`inputs.sampled`: the `samples` static flag, and `rejection` for
  verifies and proposes under `--speculative-sampling rejection`) and its tokens are draws;
  without it, the greedy program of today.
- Every program input is built by `engine.batching` from its `engine.inputs` constructor; every
  count and width comes from `capacity`.
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
from collections.abc import Callable, Sequence
from typing import get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from kernels_pallas.ops import Forward, InvariantOps, Ops, PallasInvariantOps, PallasOps, ReferenceOps
from metrale_jax.config import ModelConfig
from metrale_jax.engine import batching
from metrale_jax.engine import transitions as tr
from metrale_jax.engine.blocks import BlockManager
from metrale_jax.engine.capacity import pool_counts
from metrale_jax.engine.inputs import PrefillStatic, ProposeStatic, SpeculativeStatic, StepStatic, SwapRecord, sampled
from metrale_jax.engine.placement import place_params, reshard
from metrale_jax.engine.prefix_cache import Hit
from metrale_jax.engine.program_list import Program, Sections, serve_programs, warm_up
from metrale_jax.engine.programs import ProgramCache
from metrale_jax.engine.sampling import Sampling, SamplingRows
from metrale_jax.engine.sequences import EngineError, SequenceState
from metrale_jax.engine.settings import EngineSettings, unsupported
from metrale_jax.engine.sharding import allocate_sharded_pool, make_mesh
from metrale_jax.engine.verdict import VerdictProtocol
from metrale_jax.model.invariant import fma_contraction_pinned
from metrale_jax.model.layer_groups import arrange_layers
from metrale_jax.runtime_env import FMA_PIN_FLAG

FORWARDS: tuple[str, ...] = get_args(Forward)


def make_ops(name: str, batch_invariant: bool = False) -> Ops:
    """The ops object of a forward: `xla` (jnp reference twins) or `pallas` (kernels); with `batch_invariant`
    (the serve setting) the forward's batch-invariant variant (`InvariantOps`, `PallasInvariantOps`: the
    kernels interpreted on CPU, the mode's only backend)."""
    if batch_invariant and name == "xla":
        return InvariantOps()
    if batch_invariant and name == "pallas":
        return PallasInvariantOps()
    if name == "xla":
        return ReferenceOps()
    if name == "pallas":
        return PallasOps()
    raise EngineError(f"unknown forward {name!r} (choose from {', '.join(FORWARDS)})")


def _check_invariant_mode() -> None:
    """Refuse the batch-invariant mode where its arithmetic cannot be pinned (EngineError)."""
    if jax.default_backend() != "cpu":
        raise EngineError(f"--batch-invariant needs XLA's CPU backend (the rows kernel), not {jax.default_backend()}")
    if not fma_contraction_pinned():
        raise EngineError(
            "--batch-invariant needs XLA CPU's FMA contraction pinned before jax starts: XLA_FLAGS="
            f"{FMA_PIN_FLAG} (the metrale-jax command sets it for --batch-invariant)"
        )


@dataclasses.dataclass(frozen=True)
class SpeculativeOutput:
    """A fused speculative step's outcome for its n sequences (host numpy): accepted [n] drafts
    accepted, emitted (per sequence its accepted + 1 tokens, the verify's argmaxes), drafts [n, nd]
    int32 and confidences [n, nd] f32 of the next propose (nd = 0: none); with logits asked for,
    verify_logits [R, V] f32 (R = sum K) and draft_logits [n, nd, V] f32 (each draft position's;
    nd > 0), else None."""

    accepted: np.ndarray
    emitted: list[list[int]]
    drafts: np.ndarray
    confidences: np.ndarray
    verify_logits: np.ndarray | None = None
    draft_logits: np.ndarray | None = None


class Engine(VerdictProtocol):
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
        super().__init__()
        self.cfg = cfg
        if mesh is None:
            mesh = make_mesh(cfg, settings.tensor_parallel_size, settings.expert_parallel_size)
        self.mesh = mesh
        self.params = place_params(arrange_layers(params, cfg, layout), cfg, mesh)
        self.settings = settings
        self.dtype = params["embed"].dtype
        self.counts = pool_counts(settings, cfg)
        self.pool = allocate_sharded_pool(cfg, self.counts, settings, dtype=self.dtype, mesh=mesh)
        self.drafter = self.counts.drafter
        self.blocks = BlockManager(self.counts, settings.max_seq_len, settings.enable_prefix_caching)
        self.programs = ProgramCache()
        self._program_caches = {mesh: self.programs}  # per mesh: programs are compiled for one placement
        self.forward = forward
        self.ops = make_ops(forward, settings.batch_invariant)
        if settings.batch_invariant:
            _check_invariant_mode()
        self.replay = settings.ssm_rollback_mode == "replay"

    @property
    def draft_width(self) -> int:
        """MBd, the drafter tables' width (`PoolCounts.draft_table_width`)."""
        return self.counts.draft_table_width

    # ------------------------------------------------------------ forward selection and placement

    def set_forward(self, name: str) -> None:
        """Select the forward used from the next transition on (the model code is untouched)."""
        self.ops = make_ops(name, self.settings.batch_invariant)
        self.forward = name

    def set_mesh(self, mesh: Mesh | None) -> None:
        """Reshard the weights and the pool over `mesh` (None: the default device); the host
        bookkeeping and every sequence's state are unchanged, programs are cached per mesh.
        Refused (EngineError) while a verify awaits its verdict."""
        if self._verified:
            raise EngineError("set_mesh with a verify awaiting its verdict")
        self.params, self.pool = reshard(self.params, self.pool, self.cfg, self.mesh, mesh)
        self.mesh = mesh
        self.programs = self._program_caches.setdefault(mesh, ProgramCache())

    def disclosure(self, name: str | None = None, mesh: Mesh | None = None) -> dict:
        """What a forward compiled (plan digest, launches per step, per-program digests) on `mesh`
        (default: the current one) and, for a kernel forward, the shapes its kernels refused (run
        by the reference instead)."""
        name = name or self.forward
        cache = self.programs if mesh is None else self._program_caches.get(mesh, ProgramCache())
        ops = make_ops(name, self.settings.batch_invariant)
        out = cache.disclosure(ops.name)
        out["refusals"] = list(ops.refusals()) if hasattr(ops, "refusals") else []
        return out

    # ------------------------------------------------------------ sequences

    def alloc_sequence(self, namespace: str | None = None) -> SequenceState:
        """A fresh sequence on the lowest free slot; `namespace`: its prefix-cache namespace
        (needs --enable-prefix-caching; None: `blocks.default_namespace`, and with that None too,
        its prefills neither restore nor cache)."""
        return self.blocks.alloc(namespace)

    def free_sequence(self, seq: SequenceState) -> None:
        self.blocks.free(seq)

    # ------------------------------------------------------------ prefill / decode

    def prefill(self, seq: SequenceState, tokens: Sequence[int], chunk: int | None = None) -> np.ndarray:
        """Prefill `tokens` (appended after the sequence's cache) in chunks of at most
        `chunk` (default: the serve's prefill chunk). Returns the last position's logits [V] f32.
        A namespaced fresh sequence first restores the longest cached prefix (`seq.restored_at`,
        0 when it computed everything); a namespaced prefill caches its full blocks and takes a
        snapshot at every block-aligned program end (module docstring)."""
        return self._prefill(seq, tokens, chunk, None)[0]

    def prefill_sampled(
        self, seq: SequenceState, tokens: Sequence[int], sampling: Sampling, chunk: int | None = None
    ) -> tuple[np.ndarray, int]:
        """`prefill` with the next token drawn on the device (`sampling`'s draw at the position
        after the prompt). Returns (the last position's logits [V] f32, the drawn token)."""
        logits, token = self._prefill(seq, tokens, chunk, sampling)
        assert token is not None
        return logits, token

    def _prefill(
        self, seq: SequenceState, tokens: Sequence[int], chunk: int | None, sampling: Sampling | None
    ) -> tuple[np.ndarray, int | None]:
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise EngineError("prefill of zero tokens")
        self._check_tokens(tokens)
        chunk = min(chunk or self.counts.prefill_chunk, self.counts.prefill_chunk)
        cached = self.blocks.caches(seq)
        fresh = not (seq.seq_len or seq.blocks or seq.draft_blocks)
        hit, branch = self.blocks.lookup(seq, tokens) if fresh else (None, 0)
        if hit is not None:
            self._restore_prefix(seq, hit, tokens)
            tokens = tokens[hit.snapshot.position :]
        else:
            self.blocks.reserve([seq], [seq.seq_len + len(tokens) + 1])
        if fresh:
            seq.restored_at = hit.snapshot.position if hit is not None else 0
        static = PrefillStatic(self.cfg, self.counts, self.ops, drafter=self.drafter)
        static = static if sampling is None else sampled(static)
        rows = () if sampling is None else (batching.sampling_batch(self.counts, [sampling], 1),)
        bounds = batching.prefill_bounds(self.counts.block_size, seq.seq_len, len(tokens), chunk, cached, branch)
        for off, end in bounds:
            part = tokens[off:end]
            x = batching.prefill_chunk(self.counts, seq, part)
            *out, self.pool = self.programs.run(
                "prefill_chunk", tr.prefill_chunk, static, self.pool, self.params, x, *rows
            )
            seq.seq_len += len(part)
            seq.tokens += part
            snap = self.blocks.cache(seq) if cached else None
            if snap is not None:
                copy = batching.snapshot_copy(self.counts, seq, snap.slot, seq.seq_len)
                self.pool = self.programs.run("take_snapshot", tr.take_snapshot, None, self.pool, copy)
        seq.drafter_len = seq.seq_len - 1
        return self._fetch(out[0])[0], (int(self._fetch(out[1])[0]) if sampling is not None else None)

    def _restore_prefix(self, seq: SequenceState, hit: Hit, tokens: list[int]) -> None:
        """Restore `hit` (a prefix of `tokens`) into fresh `seq`: share its blocks and reserve the
        rest (`BlockManager.share`, all or nothing), then copy the snapshot (state, stash, partial
        drafter block) into the sequence's slot and its own drafter block."""
        p = hit.snapshot.position
        self.blocks.share(seq, hit, tokens)
        x = batching.snapshot_copy(self.counts, seq, hit.snapshot.slot, p)
        self.pool = self.programs.run("restore_snapshot", tr.restore_snapshot, None, self.pool, x)
        seq.seq_len, seq.tokens, seq.shared_len, seq.drafter_len = p, tokens[:p], p, p - 1

    @staticmethod
    def _fetch(x: jax.Array) -> np.ndarray:
        """The engine's one device-to-host transfer point: `x` as numpy."""
        return np.asarray(x)

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        bad = [t for t in tokens if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise EngineError(f"token(s) {bad[:5]} outside the vocabulary 0..{self.cfg.vocab_size - 1}")

    def _rows(
        self,
        seqs: Sequence[SequenceState],
        tokens_per_seq: Sequence[Sequence[int]],
        verify: bool,
        starts: Sequence[int] | None = None,
        sampling: Sequence[Sampling] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Run `step_rows` for seqs with ragged rows at positions starts[i].. (default: their
        lengths, which then grow by the rows); returns (logits [R, V], tokens [R]) numpy: each
        row's argmax, or with `sampling` (per sequence) its draw."""
        batch, r = batching.step_batch(self.counts, seqs, tokens_per_seq, verify, starts)
        static = StepStatic(self.cfg, self.counts, self.ops, verify=verify, drafter=self.drafter)
        static = static if sampling is None else sampled(static)
        logits, argmax, hidden, self.pool = self.programs.run(
            "step_rows", tr.step_rows, static, self.pool, self.params, batch, *self._sampling_rows(seqs, sampling)
        )
        if starts is None:
            if verify:
                self._verify_hidden = hidden
            for s, rows in zip(seqs, tokens_per_seq):
                s.seq_len += len(rows)
                s.tokens += [int(x) for x in rows]
        return self._fetch(logits)[:r], self._fetch(argmax)[:r]

    def _sampling_rows(
        self, seqs: Sequence[SequenceState], sampling: Sequence[Sampling] | None
    ) -> tuple[SamplingRows, ...]:
        """The sampling argument of a program over `seqs`: none without `sampling`, else its rows."""
        if sampling is None:
            return ()
        if len(sampling) != len(seqs):
            raise EngineError(f"{len(sampling)} sampling parameters for {len(seqs)} sequences")
        return (batching.sampling_batch(self.counts, sampling),)

    def decode_batch(self, seqs: Sequence[SequenceState], tokens: Sequence[int]) -> np.ndarray:
        """One token per sequence. Returns logits [n, V] f32."""
        return self._decode(seqs, tokens, None)[0]

    def decode_sampled(
        self, seqs: Sequence[SequenceState], tokens: Sequence[int], sampling: Sequence[Sampling]
    ) -> tuple[np.ndarray, np.ndarray]:
        """`decode_batch` with each sequence's next token drawn on the device (`sampling`, one per
        sequence). Returns (logits [n, V] f32, tokens [n] int32)."""
        return self._decode(seqs, tokens, sampling)

    def _decode(
        self, seqs: Sequence[SequenceState], tokens: Sequence[int], sampling: Sequence[Sampling] | None
    ) -> tuple[np.ndarray, np.ndarray]:
        if len(tokens) != len(seqs):
            raise EngineError(f"{len(tokens)} tokens for {len(seqs)} sequences")
        self._check_tokens(tokens)
        self.blocks.reserve(seqs, [s.seq_len + 1 for s in seqs])
        out = self._rows(seqs, [[int(t)] for t in tokens], verify=False, sampling=sampling)
        for s in seqs:
            s.drafter_len = s.seq_len - 1
        return out

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

    def _verify_rows(self, seqs: Sequence[SequenceState], tokens: Sequence[int], ks: Sequence[int]) -> list[list[int]]:
        """Check a verify of flat seq-major `tokens` with widths `ks` (refused: EngineError,
        nothing changed); sequence i's rows."""
        reason = self.can_batch_verify(seqs, ks)
        if reason:
            raise EngineError(reason)
        if len(tokens) != sum(ks):
            raise EngineError(f"{len(tokens)} tokens for ks summing to {sum(ks)}")
        self._check_tokens(tokens)
        off = np.cumsum([0, *ks]).tolist()
        return [[int(t) for t in tokens[off[i] : off[i + 1]]] for i in range(len(seqs))]

    def verify_batched(
        self,
        seqs: Sequence[SequenceState],
        tokens: Sequence[int],
        ks: Sequence[int],
        sampling: Sequence[Sampling] | None = None,
    ):
        """Batched verify with write-on-accept. tokens: flat seq-major rows, sequence i's rows
        [last_i, d_1 .. d_{K_i-1}]. On success each sequence gains K_i tokens, and its verify awaits
        its verdict (`accept`, `rollback_verify`). Returns (logits [R, V] f32, argmax [R] int32)
        with R = sum(ks); with `sampling` (per sequence) the rows' draws instead of argmaxes."""
        rows = self._verify_rows(seqs, tokens, ks)
        self.blocks.reserve(seqs, [s.seq_len + k + 1 for s, k in zip(seqs, ks)])
        before = [s.seq_len for s in seqs]
        out = self._rows(seqs, rows, verify=True, sampling=sampling)
        self._await_verdict(seqs, rows, before)
        return out

    def speculative_step(
        self,
        seqs: Sequence[SequenceState],
        tokens: Sequence[int],
        ks: Sequence[int],
        num_drafts: int,
        *,
        logits: bool = False,
        sampling: Sequence[Sampling] | None = None,
    ) -> SpeculativeOutput:
        """One scheduler step as one program (`transitions.speculative_step`): the write-on-accept
        verify of `tokens` (flat seq-major rows, sequence i's `[last_i, d_1 .. d_{K_i - 1}]`),
        greedy acceptance on the device, the verdict, and a propose of `num_drafts` drafts (0:
        none) from each committed context. One compiled-program call and one device-to-host
        transfer (`logits`: the verify's and the propose's logits too, two more). Each sequence
        gains its accepted drafts + 1 tokens, as `verify_batched` then `accept` leave it (a
        propose then trims back to the committed context). KV and drafter blocks are reserved up
        front for seq_len + K_i + num_drafts + 1 positions. Snapshot rollback only (replay
        rollback runs the composed step). With `sampling` (per sequence): gumbel speculative
        sampling, the rows' draws and the coupled drafter's drafts (`transitions.speculative_step`)."""
        if self.replay:
            raise EngineError("the fused speculative step needs --ssm-rollback-mode snapshot")
        if not 0 <= num_drafts <= self.counts.propose_drafts:
            raise EngineError(f"num_drafts {num_drafts} outside 0..{self.counts.propose_drafts}")
        pending = self._awaiting(seqs)
        if pending:
            raise EngineError(f"sequence(s) {pending} have a verify awaiting its verdict (Engine.accept)")
        rows = self._verify_rows(seqs, tokens, ks)
        self.blocks.reserve(seqs, [s.seq_len + k + num_drafts + 1 for s, k in zip(seqs, ks)])
        batch, r = batching.step_batch(self.counts, seqs, rows, verify=True)
        static = SpeculativeStatic(
            self.cfg,
            self.counts,
            self.ops,
            drafter=self.drafter,
            num_drafts=num_drafts,
            logits=logits,
        )
        static = static if sampling is None else sampled(static)
        rows_in = self._sampling_rows(seqs, sampling)
        packed, extras, self.pool = self.programs.run(
            "speculative_step", tr.speculative_step, static, self.pool, self.params, batch, *rows_in
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

    # ------------------------------------------------------------ MTP drafter

    def propose_batched(
        self,
        seqs: Sequence[SequenceState],
        last: Sequence[int],
        num_drafts: int,
        sampling: Sequence[Sampling] | None = None,
        logits: bool = True,
    ):
        """Batched MTP propose. Returns (drafts [n, nd] int32, confidences [n, nd] f32, each draft
        position's logits [n, nd, V] f32; None with `logits` False: not fetched), numpy. With
        `sampling` (per sequence) the drafts are the drafter's draws with the target's noise (the
        coupled drafter)."""
        if not self.drafter:
            raise EngineError("no MTP drafter (needs --speculative and a checkpoint with MTP layers)")
        if not 1 <= num_drafts <= self.counts.propose_drafts:
            raise EngineError(f"num_drafts {num_drafts} outside 1..{self.counts.propose_drafts}")
        self.blocks.reserve(seqs, [s.seq_len + num_drafts + 1 for s in seqs])
        n = len(seqs)
        x = batching.propose_batch(self.counts, seqs, last)
        static = ProposeStatic(self.cfg, self.counts, self.ops, num_drafts=num_drafts)
        static = static if sampling is None else sampled(static)
        drafts, conf, every, self.pool = self.programs.run(
            "propose", tr.propose, static, self.pool, self.params, x, *self._sampling_rows(seqs, sampling)
        )
        for s in seqs:
            s.last_num_drafted = num_drafts
            s.drafter_len = s.seq_len + num_drafts - 1
        return self._fetch(drafts)[:n], self._fetch(conf)[:n], self._fetch(every)[:n] if logits else None

    def trim_proposer(self, seq: SequenceState, keep: int = 0) -> None:
        """Forget the drafter rows a propose chained past the committed context, keeping `keep`.
        Host-only: the drafter KV past the context is overwritten before it is read."""
        seq.drafter_len = min(seq.drafter_len, seq.seq_len + keep)
        seq.last_num_drafted = 0

    # ------------------------------------------------------------ swap

    def save_sequence_state(self, seq: SequenceState) -> SwapRecord:
        """Swap-out record: numpy copies of everything the sequence owns on device, plus host facts."""
        at = batching.sequence_address(self.counts, seq)
        arrays, self.pool = self.programs.run("read_state", tr.read_sequence_state, None, self.pool, at)
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
        self.blocks.reserve([seq], [record.seq_len], held=(record.blocks, record.draft_blocks))
        dev = jax.tree_util.tree_map(jnp.asarray, record.device)
        at = batching.sequence_address(self.counts, seq)
        self.pool = self.programs.run("write_state", tr.write_sequence_state, None, self.pool, dev, at)
        seq.seq_len, seq.tokens, seq.drafter_len = record.seq_len, list(record.tokens), record.drafter_len

    # ------------------------------------------------------------ warm-up

    def warm_up(
        self,
        progress: Sections | None = None,
        keep: Callable[[Program], bool] | None = None,
        *,
        logits: bool = False,
        samples: bool = False,
    ) -> float:
        """Compile ahead of time every program this serve runs on the current forward and mesh
        (`program_list.serve_programs`, with `logits` the fused step's logits twins, with `samples`
        the sampling twins of the programs that select tokens; `keep`: only those it keeps), so
        that no step compiles. Returns the wall seconds."""
        programs = serve_programs(
            self.cfg, self.counts, self.settings, self.ops, self.pool, self.params, logits=logits, samples=samples
        )
        chosen = [p for p in programs if (keep is None or keep(p)) and not (self.mesh is not None and p.device_inputs)]
        return warm_up(self.programs, chosen, progress, f"warm-up ({self.forward})")
