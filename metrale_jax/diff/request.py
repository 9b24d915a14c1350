"""What a diff is asked to do, whether it can be done, and what engine it needs.

Owns: `DiffRequest` (the mode and its parameters, as the command's flags give them),
`DiffRequestError` (a request that cannot run: one clear line, a user error), the checks of a
request alone (`check`) and against an engine (`check_engine`), what an engine's verify
capacity cuts from it (`clamped`), and the sizing a command uses when the user leaves the
context and slot counts to it (`tokens_needed`, `slots_needed`).

Invariants:
- Every refusal happens before the first engine call, with one message naming the flag.
- Sizing covers the longest sequence any run of the request reaches (prompt, every verified
  row, the propose's chained rows, the swap's spacer) and every slot it holds at once.
"""

from __future__ import annotations

import dataclasses

from metrale_jax.diff.schedule import Layout, TierSpread, slot_of, tier_starts
from metrale_jax.engine.capacity import KLadder
from metrale_jax.engine.sampling import Sampling
from metrale_jax.errors import MetraleError

#: `--prefill`'s cached leg runs for prompts of at least this many tokens, with a tail this long.
CACHED_MIN_TOKENS, CACHED_TAIL = 256, 37
MODES = ("default", "batch", "verify", "verify-batch", "prefill", "swap", "generate")
K_RANGE = (2, 4)


class DiffRequestError(MetraleError, ValueError):
    """A diff request that cannot run (bad flag combination, or an engine that cannot serve it)."""


@dataclasses.dataclass(frozen=True)
class DiffRequest:
    """The flags of one diff. Exactly one mode is set (none: the default mode)."""

    steps: int
    prompts: int = 1
    batch: tuple[int, ...] = ()
    fragment_slots: bool = False
    verify: tuple[int, ...] = ()
    mtp: bool = False
    verify_batch: tuple[int, ...] = ()
    verify_batch_ks: tuple[int, ...] = ()
    prefill: tuple[int, ...] = ()
    prefill_chunk: tuple[int, ...] = ()
    swap: bool = False
    sampling: Sampling | None = None  # --temperature ... --seed: the verify modes sample (None: greedy)
    generate: bool = False
    confidence_stop: float | None = None
    tier_slots: bool = False  # --verify-batch: the sequences spread over every tier of the K ladder
    vocab_stress: bool = False  # the engine's head moves argmaxes onto the edge ids (`trunk.stress_edges`)

    def _modes_given(self) -> list[str]:
        """The non-default modes whose flag (`--<mode>`, the field of the same name) is set, in `MODES` order."""
        return [m for m in MODES[1:] if getattr(self, m.replace("-", "_"))]

    @property
    def mode(self) -> str:
        """The one non-default mode set, else "default" (`check` refuses more than one)."""
        given = self._modes_given()
        return given[0] if len(given) == 1 else "default"

    @property
    def ks(self) -> tuple[int, ...]:
        """The verify widths asked for (either verify mode)."""
        return self.verify or self.verify_batch_ks

    def check(self) -> None:
        """Refuse a request that is wrong whatever the engine (DiffRequestError)."""
        given = [f"--{m}" for m in self._modes_given()]
        problems = [
            (len(given) > 1, f"{' and '.join(given)} are separate diffs: give one mode"),
            (self.steps < 2, f"--steps must be at least 2, got {self.steps}"),
            (self.prompts < 1, f"--prompts must be at least 1, got {self.prompts}"),
            (
                bool(self.verify_batch) != bool(self.verify_batch_ks),
                "--verify-batch and --verify-batch-ks need each other",
            ),
            (
                self.mtp and not (self.verify or self.verify_batch),
                "--mtp runs the drafter of --verify or --verify-batch; give one of them",
            ),
            (
                self.fragment_slots and not (self.batch or self.verify_batch),
                "--fragment-slots applies to --batch or --verify-batch",
            ),
            (self.tier_slots and not self.verify_batch, "--tier-slots applies to --verify-batch"),
            (
                self.tier_slots and self.fragment_slots,
                "--tier-slots and --fragment-slots are two slot layouts: give one",
            ),
            (bool(self.prefill_chunk) and not self.prefill, "--prefill-chunk needs --prefill"),
            (
                self.sampling is not None and not self.ks,
                "--temperature samples the verify modes' tokens: give --verify or --verify-batch",
            ),
            (
                self.confidence_stop is not None and not self.generate,
                "--confidence-stop applies to --generate",
            ),
            (
                self.swap and self.steps < 4,
                f"--swap needs at least 4 steps (two each side of the spill), got {self.steps}",
            ),
        ]
        problems += [
            (n < 2, f"{flag} width {n}: a batch is at least 2 sequences")
            for flag, ns in (("--batch", self.batch), ("--verify-batch", self.verify_batch))
            for n in ns
        ]
        problems += [
            (not K_RANGE[0] <= k <= K_RANGE[1], f"{flag} {k}: K must be in {K_RANGE[0]}..{K_RANGE[1]}")
            for flag, ks in (("--verify", self.verify), ("--verify-batch-ks", self.verify_batch_ks))
            for k in ks
        ]
        problems += [
            (x < 1, f"{flag} {x}: must be at least 1")
            for flag, xs in (("--prefill", self.prefill), ("--prefill-chunk", self.prefill_chunk))
            for x in xs
        ]
        for bad, message in problems:
            if bad:
                raise DiffRequestError(message)

    def layout(self, ladder: KLadder) -> Layout:
        """The slot layout of the request's batches on an engine with K ladder `ladder`."""
        return TierSpread(ladder) if self.tier_slots else self.fragment_slots

    def check_layout(self, ladder: KLadder) -> None:
        """Refuse a `--tier-slots` width too narrow for the ladder's tiers (DiffRequestError)."""
        tiers = len(tier_starts(ladder))
        for n in self.verify_batch if self.tier_slots else ():
            if n < tiers:
                raise DiffRequestError(
                    f"--tier-slots: --verify-batch width {n} cannot hold a sequence in each of the K ladder's "
                    f"{tiers} tiers (give widths >= {tiers})"
                )

    def slots_needed(self, ladder: KLadder | None = None) -> int:
        """Sequence slots the request holds at once (a swap holds a spacer and the restored);
        with `--tier-slots`, on an engine with K ladder `ladder` (None: as if packed)."""
        widest = max(self.batch or self.verify_batch or (1,))
        if self.tier_slots and ladder is not None:
            self.check_layout(ladder)
            return max(TierSpread(ladder).slots(n)[-1] + 1 for n in self.verify_batch)
        return {"swap": 2, "generate": 3}.get(self.mode, widest + int(self.fragment_slots))

    def tokens_needed(self, num_drafts: int) -> int:
        """The longest sequence (in tokens, the KV block the next token opens included) any run
        of the request reaches with `num_drafts` drafts per propose."""
        widest = max(self.batch or self.verify_batch or (1,))
        batch_prompt = 12 + 7 * min(widest - 1, 15)
        single_prompt = 23 + 41 * (self.prompts - 1 if self.mode == "default" else 0)
        prompt = batch_prompt if self.batch or self.verify_batch else single_prompt
        if self.prefill:
            return max(self.prefill) + (CACHED_TAIL if max(self.prefill) >= CACHED_MIN_TOKENS else 0) + 2
        if self.ks:
            return prompt + self.steps * max(self.ks) + num_drafts + 3
        if self.generate:  # batch_prompts(3): the longest is 26 tokens; a step may run num_drafts past the end
            return 26 + self.steps + 2 * num_drafts + 3
        return prompt + self.steps + 2

    def check_engine(self, engine) -> None:
        """Refuse a request this engine cannot serve (DiffRequestError)."""
        s = engine.settings
        ladder = s.k_ladder if self.tier_slots else None
        if ladder is not None:
            self.check_layout(ladder)
        mode_flag, ks_flag = ("--verify", "--verify") if self.verify else ("--verify-batch", "--verify-batch-ks")
        k_top = max(self.ks, default=0)
        problems = [
            (bool(self.ks) and not s.speculative, f"{mode_flag} verifies drafts: it needs --speculative"),
            (k_top - 1 > s.num_drafts, f"{ks_flag} {k_top} needs --num-drafts >= {k_top - 1} (got {s.num_drafts})"),
            (self.mtp and not engine.drafter, "--mtp needs a checkpoint with an MTP layer and --speculative"),
            (
                self.generate and not engine.drafter,
                "--generate runs the MTP scheduler: it needs a checkpoint with an MTP layer and --speculative",
            ),
            (
                self.vocab_stress != getattr(getattr(engine, "cfg", None), "vocab_stress", False),
                "--vocab-stress is the engine's own head: build the engine with cfg.vocab_stress as the request asks",
            ),
            (
                self.slots_needed(ladder) > s.max_batch_size,
                f"this diff holds {self.slots_needed(ladder)} sequences at once: it needs --max-batch-size >= "
                f"{self.slots_needed(ladder)} (got {s.max_batch_size})",
            ),
            (
                self.tokens_needed(s.num_drafts) > s.max_seq_len,
                f"this diff reaches {self.tokens_needed(s.num_drafts)} tokens: it needs --max-seq-len >= "
                f"{self.tokens_needed(s.num_drafts)} (got {s.max_seq_len})",
            ),
        ]
        for bad, message in problems:
            if bad:
                raise DiffRequestError(message)

    def clamped(self, counts, ladder: KLadder = ()) -> list[str]:
        """One line per asked-for K that some sequence's slot cannot verify (`counts`: the
        engine's `PoolCounts`, `ladder` its K ladder, needed with `--tier-slots`): the verify
        modes run those sequences at their slot's capacity (`schedule.capped`), and the report
        says so."""
        flag = "--verify" if self.verify else "--verify-batch-ks"
        out = []
        layout = self.layout(ladder)
        for n in (1,) if self.verify else self.verify_batch:
            caps = [counts.slot_draft_capacity(slot_of(i, n, layout)) + 1 for i in range(n)]
            for k in sorted(set(self.ks), reverse=True):
                short = [i for i, cap in enumerate(caps) if cap < k]
                if short:
                    of = "" if self.verify else f" of --verify-batch {n}"
                    out.append(
                        f"{flag} {k}: sequence(s) {short}{of} sit on slots that verify at most "
                        f"K={min(caps[i] for i in short)} (the K ladder and --num-drafts): they ran at their slot's K"
                    )
        return out
