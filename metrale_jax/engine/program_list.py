"""The programs a serve runs, listed once: what `Engine.warm_up` compiles and the planner analyses.

Owns: `Program` (one transition call as the `Engine` makes it), `serve_programs` (every program a
serve at given counts and settings runs, for one forward), `batch_widths` and `prefill_buckets`
(the shapes the engine pads to), `generation_programs` (the part of the list a generation runs),
and `warm_up` (a list compiled into a `ProgramCache` ahead of time, side by side).

The list, in this order, for the forward of `ops`:
- `prefill`: `prefill_chunk` at every prefill bucket (`PoolCounts.prefill_bucket`);
- at every batch width (`capacity.DECODE_BATCH_LADDER` rungs up to `bucket_width(real_slots)`):
  `decode` (`step_rows`, T = 1); speculative serves: `verify` (T = K, write-on-accept) and
  `restore_ckpt`, under snapshot rollback `gdn_fold` and `commit_conv` (replay rollback's commit
  re-runs the verify); with the MTP drafter `propose` at each draft count 1..num_drafts and
  `stash_rows`; speculative serves under snapshot rollback the fused `speculative` step at each
  draft count the scheduler asks for (0..num_drafts with the drafter, else 0), and with `logits`
  its logits-returning twins (the diff's);
- with prefix caching: `restore_snapshot` and `take_snapshot`;
- `read_state` and `write_state` (swap).

Invariants:
- Every input comes from its `engine.inputs` constructor (`X.padded`, abstract): the engine fills
  the same structures' real rows, so a program of this list and the engine's call of it share one
  `ProgramCache` key (name, static, argument shapes and dtypes) and one compiled program.
- `serve_programs` is pure and builds no input until a program's `args` is read, so a filter over
  a long list (the planner keeps a few) costs nothing for the programs it drops.
- An input the device produces (a verify's hidden rows, a swap record's arrays) is a shape
  struct without a sharding (`Program.device_inputs`): right on one device; under a mesh the
  engine's call carries the mesh's shardings, so `Engine.warm_up` leaves those programs to their
  first call there.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import jax

from kernels_pallas.ops import Ops
from metrale_jax import runtime_env
from metrale_jax.config import ModelConfig
from metrale_jax.engine import transitions as tr
from metrale_jax.engine.capacity import DECODE_BATCH_LADDER, PoolCounts, bucket_width
from metrale_jax.engine.inputs import (
    ModelStatic,
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
    VerdictBatch,
    abstract,
    sampled,
)
from metrale_jax.engine.programs import ProgramCache
from metrale_jax.engine.sampling import SamplingRows
from metrale_jax.engine.settings import EngineSettings


@dataclasses.dataclass(frozen=True)
class Program:
    """One transition call as the Engine makes it: report `name`, the `ProgramCache` name
    (`transition`), the function, its static part, `width` (sequences; a prefill's token bucket),
    `shape` (for reports) and `build`, which makes its arguments (pool, [params,] inputs).
    `trunk_free`: the program runs no trunk layer and passes the trunk's pool leaves through
    donated, so its bytes do not depend on the depth (the planner's depth probe compiles it once).
    `device_inputs`: an input is a device output of another program (module docstring)."""

    name: str
    transition: str
    fn: Callable
    static: ModelStatic | None
    width: int
    shape: str
    build: Callable[[], tuple] = dataclasses.field(repr=False, compare=False)
    trunk_free: bool = False
    device_inputs: bool = False

    @functools.cached_property
    def args(self) -> tuple:
        """The call's arguments, built on first read."""
        return self.build()


def batch_widths(counts: PoolCounts) -> tuple[int, ...]:
    """The widths a batch of 1..real_slots sequences is padded to (`bucket_width`)."""
    top = bucket_width(counts.real_slots)
    return tuple(w for w in DECODE_BATCH_LADDER if w <= top)


def prefill_buckets(counts: PoolCounts, lengths: Sequence[int] | None = None) -> tuple[int, ...]:
    """The prefill buckets (`PoolCounts.prefill_bucket`) of every chunk length 1..prefill_chunk,
    ascending; with `lengths`, those of the chunks an uncached prefill of each length runs (whole
    chunks, then the rest)."""
    chunk = counts.prefill_chunk
    if lengths is None:
        sizes = [*(1 << i for i in range(chunk.bit_length())), chunk]
    else:
        sizes = [n for length in lengths for n in (min(length, chunk), length % chunk) if n]
    return tuple(sorted({counts.prefill_bucket(n) for n in sizes}))


def serve_programs(
    cfg: ModelConfig,
    counts: PoolCounts,
    settings: EngineSettings,
    ops: Ops,
    pool: Any,
    params: Any,
    *,
    logits: bool = False,
    samples: bool = False,
) -> tuple[Program, ...]:
    """Every program a serve at `counts` and `settings` runs on the forward of `ops`, on `pool`
    and `params` (arrays, or shape structs carrying the engine's shardings), in the module
    docstring's order. `logits`: also the fused step's logits-returning programs; `samples`: the
    programs that select tokens (prefill, decode, verify, propose, the fused step) are their
    sampling twins (static `samples`, a `SamplingRows` argument after the program's input)."""
    drafter, mbd, k = counts.drafter, counts.draft_table_width, counts.k
    snapshot = counts.speculative and settings.ssm_rollback_mode == "snapshot"
    nd_max = settings.num_drafts if drafter else 0
    out: list[Program] = []

    def add(name, transition, fn, static, width, shape, *inputs: Callable[[], Any], model=True, **flags):
        head = (pool, params) if model else (pool,)
        if model and samples:
            static = sampled(static)
            inputs = (*inputs, _padded(SamplingRows.padded, counts, 1 if name == "prefill" else width))
        build = functools.partial(_arguments, head, inputs)
        out.append(Program(name, transition, fn, static, width, shape, build, **flags))

    prefill = PrefillStatic(cfg, counts, ops, drafter=drafter)
    for tb in prefill_buckets(counts):
        add(
            "prefill",
            "prefill_chunk",
            tr.prefill_chunk,
            prefill,
            tb,
            f"1x{tb} tokens",
            _padded(PrefillChunk.padded, counts, mbd, tb),
        )
    for w in batch_widths(counts):
        verdicts = _padded(VerdictBatch.padded, counts, w)
        for verify in (False, True) if counts.speculative else (False,):
            t = k if verify else 1
            add(
                "verify" if verify else "decode",
                "step_rows",
                tr.step_rows,
                StepStatic(cfg, counts, ops, verify=verify, drafter=drafter),
                w,
                f"{w}x{t} rows",
                _padded(StepBatch.padded, counts, mbd, w, t, verify=verify),
            )
        if snapshot:
            add("gdn_fold", "gdn_fold", tr.gdn_fold_accepted, None, w, f"{w} verdicts", verdicts, model=False)
            add("commit_conv", "commit_conv", tr.commit_conv, None, w, f"{w} verdicts", verdicts, model=False)
        if counts.speculative:
            add("restore_ckpt", "restore_ckpt", tr.restore_checkpoint, None, w, f"{w} verdicts", verdicts, model=False)
        for nd in range(1, nd_max + 1):
            add(
                "propose",
                "propose",
                tr.propose,
                ProposeStatic(cfg, counts, ops, num_drafts=nd),
                w,
                f"{w} seqs x {nd} drafts",
                _padded(ProposeBatch.padded, counts, mbd, w),
                trunk_free=True,
            )
        if drafter:
            add(
                "stash_rows",
                "stash_rows",
                tr.stash_hidden_rows,
                None,
                w,
                f"{w} rows",
                functools.partial(_hidden_rows, pool, w * k),
                _padded(StashBatch.padded, counts, w),
                model=False,
                device_inputs=True,
            )
        for lg in (False, True) if logits else (False,):
            for nd in range(nd_max + 1) if snapshot else ():
                add(
                    "speculative",
                    "speculative_step",
                    tr.speculative_step,
                    SpeculativeStatic(cfg, counts, ops, drafter=drafter, num_drafts=nd, logits=lg),
                    w,
                    f"{w}x{k} rows + {nd} drafts",
                    _padded(StepBatch.padded, counts, mbd, w, k, verify=True),
                )
    if counts.snapshot_slots:
        snap = _padded(SnapshotCopy.padded, counts)
        add("restore_snapshot", "restore_snapshot", tr.restore_snapshot, None, 1, "1 copy", snap, model=False)
        add("take_snapshot", "take_snapshot", tr.take_snapshot, None, 1, "1 copy", snap, model=False)
    address = _padded(SequenceAddress.padded, counts, mbd)
    add("read_state", "read_state", tr.read_sequence_state, None, 1, "1 sequence", address, model=False)
    add(
        "write_state",
        "write_state",
        tr.write_sequence_state,
        None,
        1,
        "1 sequence",
        functools.partial(_swap_arrays, pool, address),
        address,
        model=False,
        device_inputs=True,
    )
    return tuple(out)


def _arguments(head: tuple, inputs: Sequence[Callable[[], Any]]) -> tuple:
    return (*head, *(make() for make in inputs))


def _padded(constructor: Callable, *args: Any, **kwargs: Any) -> Callable[[], Any]:
    """A builder of the abstract input `constructor(*args, **kwargs)` (an `X.padded`)."""
    return lambda: abstract(constructor(*args, **kwargs))


def _hidden_rows(pool: Any, rows: int) -> jax.ShapeDtypeStruct:
    """A verify's hidden rows (`step_rows`' third output): `rows` rows of the drafter stash's
    width and dtype, which they are stashed into."""
    return jax.ShapeDtypeStruct((rows, pool.stash.shape[-1]), pool.stash.dtype)


def _swap_arrays(pool: Any, address: Callable[[], Any]) -> Any:
    """The `SwapArrays` a swap-out of `pool` returns (what a swap-in writes back), abstract."""
    return jax.eval_shape(tr.read_sequence_state, pool, address())[0]


#: The programs each scheduler path of `engine.speculative` runs after the prefill: plain greedy
#: decoding, the fused speculative step (and the propose after the prefill), the composed step.
PATH_PROGRAMS: dict[str, tuple[str, ...]] = {
    "greedy": ("decode",),
    "fused": ("propose", "speculative"),
    "composed": ("verify", "gdn_fold", "commit_conv", "restore_ckpt", "stash_rows", "propose"),
}


def generation_programs(counts: PoolCounts, prompt_lengths: Sequence[int], path: str) -> Callable[[Program], bool]:
    """Which programs a generation of prompts of `prompt_lengths` on scheduler `path` (a key of
    `PATH_PROGRAMS`) runs: their prefills' buckets (`prefill_buckets`, uncached), and the path's
    programs at the widths of 1..len(prompts) sequences (the fused step at every draft count)."""
    buckets = set(prefill_buckets(counts, prompt_lengths))
    top = bucket_width(len(prompt_lengths))

    def keep(p: Program) -> bool:
        if p.name == "prefill":
            return p.width in buckets
        return p.name in PATH_PROGRAMS[path] and p.width <= top

    return keep


class Sections(Protocol):
    """A progress display (`diff.progress.Progress`): a section of `total` units, advanced unit by unit."""

    def section(self, label: str, total: int) -> None: ...

    def advance(self, units: int = 1) -> None: ...


def warm_up(
    cache: ProgramCache, programs: Sequence[Program], progress: Sections | None = None, label: str = "warm-up"
) -> float:
    """Compile each of `programs` into `cache` ahead of time (`ProgramCache.lower`: keyed as its
    `run` keys, so the first real call is a hit): traced and lowered one by one here (Python holds
    the GIL), each compiled on a pool of the allowed cores while the next lowers (XLA compiles
    without it); `progress` gets one section (`label`) and a unit per program. Returns the wall
    seconds."""
    t0 = time.perf_counter()
    if progress is not None:
        progress.section(label, len(programs))

    def advance(*_: Any) -> None:
        if progress is not None:
            progress.advance()

    with ThreadPoolExecutor(runtime_env.allowed_cores()) as pool:
        futures = []
        for p in programs:
            compile = cache.lower(p.transition, p.fn, p.static, *p.args)
            if compile is None:
                advance()
                continue
            futures.append(pool.submit(compile))
            futures[-1].add_done_callback(advance)
        for f in futures:
            f.result()
    return time.perf_counter() - t0
