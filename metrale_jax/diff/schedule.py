"""What the verify diffs feed and how they count: shapes, slots, caps, drafts, accepts, controls.

Owns the pure, host-side rules (tests/test_diff.py's unit cases test each one):
`batch_shapes` (uniform shapes per K, then one ragged shape deepest first), `slot_of` (where
`--fragment-slots` puts each sequence), `capped` (each K capped by its slot's verify capacity),
`offsets`, `step_drafts` (the greedy continuation with one draft corrupted on odd steps),
`accepted` (leading drafts the verify's argmax agrees with), `control_row` and the accept
coverage / histogram a verify report shows; `tier_starts` / `tier_slots` (where `--tier-slots`
puts each sequence: spread over every tier of the K ladder).

A layout (`Layout`) is False (sequence i on slot i), True (`--fragment-slots`) or a `TierSpread`
(`--tier-slots`: each width's slots, strictly increasing, from the K ladder).

Invariant: pure functions of plain ints and lists; no engine, no numpy state.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence

from metrale_jax.engine.capacity import MTP_STATE_SLOTS_FLOOR, KLadder


@dataclasses.dataclass(frozen=True)
class TierSpread:
    """`--tier-slots` over `ladder`: a batch of n sequences sits on `tier_slots(n, ladder)`."""

    ladder: KLadder

    def slots(self, n: int) -> tuple[int, ...]:
        return tier_slots(n, self.ladder)


#: A batch's slot layout: False (slot i), True (`--fragment-slots`) or a `TierSpread` (`--tier-slots`).
Layout = bool | TierSpread


def batch_shapes(n: int, ks: Sequence[int]) -> list[list[int]]:
    """The per-sequence widths a batch of `n` verifies at: one uniform shape per distinct K,
    deepest first; then, with at least two Ks and `n >= len(Ks)`, one ragged shape that splits
    the n sequences over the Ks as evenly as possible (the remainder to the deeper Ks), deepest
    first (the order the engine's batch permutation gives)."""
    kinds = sorted(set(ks), reverse=True)
    out = [[k] * n for k in kinds]
    if len(kinds) > 1 and n >= len(kinds):
        per, extra = divmod(n, len(kinds))
        out.append([k for i, k in enumerate(kinds) for _ in range(per + (i < extra))])
    return out


def slot_of(i: int, n: int, fragment: Layout) -> int:
    """The slot sequence i of n takes when allocated in batch order from an empty pool; with
    `fragment` True, a spare allocated just before sequence n // 2 holds one slot in between; a
    `TierSpread` names each sequence's slot (spares hold the slots in between)."""
    if isinstance(fragment, TierSpread):
        return fragment.slots(n)[i]
    return i + int(fragment and i >= n // 2)


def tier_starts(ladder: KLadder) -> list[int]:
    """The first slot of each step of the K ladder that has verify state whatever the settings
    (below `MTP_STATE_SLOTS_FLOOR`): step j holds the slots s with `n_max[j-1] <= s < n_max[j]`
    (a sequence on slot s implies s + 1 active, `capacity.verify_slot_drafts`)."""
    starts = [0, *(n_max for n_max, _ in ladder[:-1])]
    return [s for s in starts if s < MTP_STATE_SLOTS_FLOOR]


def tier_slots(n: int, ladder: KLadder) -> tuple[int, ...]:
    """`--tier-slots`: the slots of n sequences split over the ladder's tiers (`tier_starts`) as
    evenly as possible (the remainder to the deeper, first tiers), each group on consecutive
    slots from its tier's first one (a group longer than its tier runs on into the next).
    Requires n >= the number of tiers (ValueError otherwise), so every tier holds a sequence
    and, with two per tier, a slot's neighbour verifies in the same step."""
    starts = tier_starts(ladder)
    if n < len(starts):
        raise ValueError(f"{n} sequences cannot cover the K ladder's {len(starts)} tiers")
    per, extra = divmod(n, len(starts))
    out: list[int] = []
    for t, start in enumerate(starts):
        for j in range(per + (t < extra)):
            out.append(max(start + j, out[-1] + 1 if out else 0))
    return tuple(out)


def capped(shape: Sequence[int], cap: Callable[[int], int]) -> list[int]:
    """`shape` with sequence i's K at most `cap(i)` (its slot's verify capacity, drafts + 1)."""
    return [min(k, cap(i)) for i, k in enumerate(shape)]


def dedup_consecutive(shapes: Sequence[list[int]]) -> list[list[int]]:
    """Shapes with consecutive repeats removed (capping can make neighbours equal)."""
    return [s for i, s in enumerate(shapes) if i == 0 or s != shapes[i - 1]]


def offsets(ks: Sequence[int]) -> list[int]:
    """Prefix sums of `ks`: sequence i's first flat verify row, then the total row count."""
    out = [0]
    for k in ks:
        out.append(out[-1] + k)
    return out


def step_drafts(greedy: Sequence[int], pos: int, step: int, k: int, vocab: int) -> list[int]:
    """The K - 1 drafts of a verify at committed offset `pos`: draft j is `greedy[pos + j]` (0
    past its end); on odd `step`, draft `1 + step mod (K - 1)` is bumped by one (mod vocab),
    so full and partial accepts both occur."""
    drafts = [greedy[pos + j] if pos + j < len(greedy) else 0 for j in range(1, k)]
    if step % 2 == 1 and k > 1:
        j = step % (k - 1)
        drafts[j] = (drafts[j] + 1) % vocab
    return drafts


def control_row(n: int, left_out: Sequence[int]) -> int:
    """The row a batch control changes: the first from n // 2 upward (wrapping) that no
    comparison left out; n // 2 when every row was."""
    return next((r % n for r in range(n // 2, n // 2 + n) if r % n not in left_out), n // 2)


def accept_coverage(accepted_log: Sequence[Sequence[int]], ks: Sequence[int]) -> tuple[int, int]:
    """(full, partial) accepts over every (step, sequence) pair: na == K - 1, na < K - 1."""
    pairs = [(a, k) for step in accepted_log for a, k in zip(step, ks)]
    return sum(a == k - 1 for a, k in pairs), sum(a < k - 1 for a, k in pairs)


def accept_histogram(accepted_log: Sequence[Sequence[int]]) -> dict[int, int]:
    """How many (step, sequence) pairs accepted each number of drafts."""
    return dict(sorted(Counter(a for step in accepted_log for a in step).items()))
