"""Engine step runners for timing: a prefill, a decode step and a verify step that each leave
the engine as they found it, so the same step can be timed again and again.

Owns: `max_seq_len_for` (the engine size a benchmark's sequences need), `StepBench` (an `Engine`
plus the sequences it keeps as decode/verify contexts) and `DeviceStep` (one compiled program of
an engine call, re-run alone to time the device work without the host's bookkeeping and the
logits' copy to the host).

Reset rules: a prefill runs on a fresh sequence that is freed afterwards; a decode step is
undone on the host (`rewind`; the GDN state has advanced, which changes values but not the
work); a verify step is abandoned with `rollback_verify` (the pre-verify state comes back),
whose device program is waited for before the next call, untimed.
Every timing includes the host copy of the logits (`np.asarray`), hence the device's completion.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from benchmarks.models import settings
from metrale_jax.engine.engine import Engine
from metrale_jax.engine.pool import EnginePool


def max_seq_len_for(tokens: int, block: int = 16) -> int:
    """The max-seq-len of an engine whose sequences reach `tokens` tokens: whole KV blocks of
    `block` tokens, with one token and one block to spare beyond them."""
    return block * (-(-(tokens + 1 + block) // block))


class StepBench:
    """An engine for the timed steps. speculative engines verify K = num_drafts + 1 rows per
    sequence (the engine pads every verify to K_max; one engine per K keeps the work exact)."""

    def __init__(
        self,
        cfg,
        params,
        *,
        max_batch: int,
        max_seq_len: int,
        speculative: bool = False,
        num_drafts: int = 1,
        forward: str = "xla",
        **flags,
    ):
        spec = dict(speculative=True, num_drafts=num_drafts) if speculative else {}
        self.engine = Engine(
            cfg, params, settings(max_batch_size=max_batch, max_seq_len=max_seq_len, **spec, **flags), forward=forward
        )
        self.contexts: dict[str, list] = {}

    @classmethod
    def verifying(cls, cfg, params, *, max_batch: int, max_seq_len: int, k: int, **flags) -> StepBench:
        """A speculative engine whose every slot may verify K = `k` rows: num_drafts = k - 1 and a
        K ladder of one rung, `max_batch:k - 1`. `flags` as for the constructor."""
        return cls(
            cfg,
            params,
            max_batch=max_batch,
            max_seq_len=max_seq_len,
            speculative=True,
            num_drafts=k - 1,
            mtp_k_ladder=f"{max_batch}:{k - 1}",
            **flags,
        )

    # ------------------------------------------------------------ prefill
    def prefill(self, tokens: Sequence[int]) -> tuple[float, np.ndarray]:
        """Seconds of one prefill of `tokens` (one chunk when it fits) and its last logits."""
        eng = self.engine
        seq = eng.alloc_sequence()
        try:
            t0 = time.perf_counter()
            logits = eng.prefill(seq, tokens)
            return time.perf_counter() - t0, logits
        finally:
            eng.free_sequence(seq)

    # ------------------------------------------------------------ contexts
    def context(self, name: str, prompts: Sequence[Sequence[int]]) -> list:
        """Prefill one sequence per prompt and keep them as context `name`."""
        seqs = [self.engine.alloc_sequence() for _ in prompts]
        for s, p in zip(seqs, prompts):
            self.engine.prefill(s, p)
        self.contexts[name] = seqs
        return seqs

    def free_context(self, name: str) -> None:
        for s in reversed(self.contexts.pop(name)):
            self.engine.free_sequence(s)

    # ------------------------------------------------------------ steps
    def decode(self, name: str, tokens: Sequence[int]) -> tuple[float, np.ndarray]:
        """Seconds of one decode step of context `name` (one token per sequence); undone on the host."""
        seqs = self.contexts[name]
        t0 = time.perf_counter()
        logits = self.engine.decode_batch(seqs, tokens)
        secs = time.perf_counter() - t0
        for s in seqs:
            self.engine.blocks.rewind(s, 1)
        return secs, logits

    def verify(self, name: str, rows: Sequence[Sequence[int]]) -> tuple[float, np.ndarray]:
        """Seconds of one batched verify of `rows` (one list of K tokens per sequence of context
        `name`), logits [sum K, V]; then rolled back (state, length and tokens as before)."""
        seqs = self.contexts[name]
        ks = [len(r) for r in rows]
        t0 = time.perf_counter()
        logits, _ = self.engine.verify_batched(seqs, [t for r in rows for t in r], ks)
        secs = time.perf_counter() - t0
        self.engine.rollback_verify(seqs)
        # NOTE: the rollback is a device program dispatched asynchronously; waiting for it here,
        # untimed, keeps it out of the next timed call (back-to-back timings ran into it).
        jax.block_until_ready(self.engine.pool)
        return secs, logits


class DeviceStep:
    """Captures the engine's next call of program `name` (`step_rows`: decode / verify;
    `prefill_chunk`) with its arguments and re-runs that compiled program alone: `time(iters)` is
    the median seconds of the device work (the pool is donated and fed back, every output waited
    for), without the host bookkeeping around it and without the logits' copy to the host.
    Re-running rewrites the same rows (state values change, never shapes or addresses)."""

    def __init__(self, engine: Engine, name: str = "step_rows"):
        self.engine = engine
        self.name = name
        self.captured = None
        programs = engine.programs
        orig = programs.run

        def run(name_, fn, static, *args):
            out = orig(name_, fn, static, *args)
            if name_ == self.name and self.captured is None:
                self.captured = (name_, fn, static, args[1:])
            return out

        self._orig = orig
        programs.run = run  # type: ignore[method-assign]  # this engine's calls only, not the class's

    @classmethod
    def capture(cls, engine: Engine, call, name: str = "step_rows"):
        """Run `call()` with the engine's next `name` program captured (it compiles there when
        new); returns (the DeviceStep, call's result)."""
        dev = cls(engine, name)
        try:
            out = call()
        finally:
            dev.release()
        return dev, out

    def release(self) -> None:
        """Stop capturing (the engine's own `run` again)."""
        self.engine.programs.run = self._orig  # type: ignore[method-assign]  # undoes the wrapper

    def time(self, iters: int, program: Callable | None = None) -> float:
        """Median seconds of `iters` runs after one; `program(pool, *arguments)`: another compilation of
        the captured program (e.g. traced) run instead of the engine's."""
        if self.captured is None:
            raise RuntimeError(f"no {self.name} call captured yet")
        name, fn, static, rest = self.captured
        run = program or (lambda pool, *a: self._orig(name, fn, static, pool, *a))
        times = []
        for _ in range(iters + 1):
            t0 = time.perf_counter()
            out = run(self.engine.pool, *rest)
            self.engine.pool = out if isinstance(out, EnginePool) else out[-1]  # a verdict returns the pool alone
            jax.block_until_ready(out)
            times.append(time.perf_counter() - t0)
        return float(np.median(times[1:]))
