"""What a diff run records, and the one comparison of a replay against the reference.

Owns: `Part` (one named array a run produced), `Recording` (a run's prefill parts, its per-step parts
and its timings), `Contract` (what a variant promises: bit-identical, or bounded by a declared
relative tolerance with every argmax equal), `diff_part` (one part pair, element by element)
and `compare` (a whole run against the reference, step by step). How a difference is worded is
`report`'s.

Invariants:
- Byte equality is judged on the raw bytes; values, hex, ULP distance and |Δ| only describe a
  difference, they never excuse one under the bit-identical contract.
- A bounded contract fails on any element past its tolerance, on any logits row whose argmax
  differs, and on any differing token; the tolerance is `max(rtol, 2 eps(dtype))` times the
  largest finite |value| of the reference part, so storage rounding (fp8 KV) is never past it.
  With `argmax_gap` a logits row whose argmax differs fails only where the reference's own gap
  between its argmax and the replay's is over the tolerance (a near-tie the rounding may flip).
- A propose is recorded as `propose_parts`: each draft position's logits, then the drafts and
  their confidences. Under `argmax_gap` a sequence whose greedy draft j flips where the reference's
  gap between the two drafts is within the tolerance (`draft_chain_cuts`) is compared up to that
  draft: the later drafts, their logits and the confidences from j on follow another token, and are
  not judged (their bytes still count as differing, and `Comparison.excused_draft_flips` counts them).
- Structural differences (part names, shapes, dtypes, step counts) are violations of every
  contract.
- Argmax ties go to the lowest index (numpy's rule, as the engine's).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import chex
import ml_dtypes
import numpy as np

KINDS = ("logits", "values", "tokens")
Step = int | str  # a step index, or "prefill"


@dataclasses.dataclass(frozen=True)
class Part:
    """One array a run produced. kind: `logits` ([rows, vocab] float: argmax per row matters),
    `values` (any float array: states, confidences) or `tokens` (integers: drafts)."""

    name: str
    data: np.ndarray
    kind: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"part {self.name!r}: kind {self.kind!r} is not one of {KINDS}")


@dataclasses.dataclass
class Recording:
    """What one run recorded: the parts after the prefill, the parts after each step, and per-step wall times
    (`enqueue_ms`: the forward call alone; `step_ms`: the whole step, verdict and propose
    included). `settled`: per step index, parts already compared with the reference's as they were
    recorded (`state.settle_pools`), held as their `PartDiff`s instead of their arrays; `compare` counts them
    after the step's other parts."""

    prefill: list[Part]
    steps: list[list[Part]] = dataclasses.field(default_factory=list)
    enqueue_ms: list[float] = dataclasses.field(default_factory=list)
    step_ms: list[float] = dataclasses.field(default_factory=list)
    settled: dict[int, Settled] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Contract:
    """What a variant promises against the reference: bit-identical (`rtol` None) or bounded."""

    rtol: float | None = None
    reason: str = ""
    #: Excuse an argmax flip where the reference's gap between the two argmaxes is within the tolerance.
    argmax_gap: bool = False

    @property
    def bounded(self) -> bool:
        return self.rtol is not None

    def describe(self) -> str:
        if not self.bounded:
            return f"bit-identical ({self.reason})" if self.reason else "bit-identical"
        argmax = "argmax equal unless the reference's gap ≤ the bound" if self.argmax_gap else "argmax equal"
        return f"bounded: |Δ| ≤ max({self.rtol:g}, 2 eps)·max|ref| per part, {argmax} ({self.reason})"

    def tolerance(self, ref: np.ndarray, dtype) -> float:
        """The largest |Δ| allowed for an element of a float part of storage `dtype` whose
        reference values (as float64) are `ref`."""
        finite = ref[np.isfinite(ref)]
        scale = float(np.abs(finite).max()) if finite.size else 0.0
        return max(self.rtol or 0.0, 2 * float(ml_dtypes.finfo(dtype).eps)) * scale


BIT_IDENTICAL = Contract()


def bounded(rtol: float, reason: str) -> Contract:
    return Contract(rtol=rtol, reason=reason)


def combine(a: Contract, b: Contract) -> Contract:
    """The contract of a run that differs from the reference in both a's and b's way."""
    if a.rtol is None:
        return b
    if b.rtol is None:
        return a
    return Contract(max(a.rtol, b.rtol), f"{a.reason}; {b.reason}", a.argmax_gap or b.argmax_gap)


@dataclasses.dataclass
class PartDiff:
    """How one part differs. `first`: the first differing element; `violation`: the first
    contract violation (None: the part keeps its contract); `bad_rows`: per row (axis 0),
    whether it violates the contract."""

    differing_bytes: int = 0
    max_abs: float = 0.0
    max_ulp: int | None = None
    argmax_equal: bool = True
    first: dict | None = None
    violation: dict | None = None
    bad_rows: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, bool))


def _unsigned(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.dtype(f"u{a.dtype.itemsize}"))


def _ordered(u: np.ndarray, itemsize: int) -> np.ndarray:
    """Sign-magnitude float bits as integers ordered like the values (ULP steps apart)."""
    sign = np.uint64(1) << np.uint64(8 * itemsize - 1)
    u = u.astype(np.uint64)
    mag = (u & ~sign).astype(np.int64)
    return np.where(u & sign, -mag, mag)


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| in units in the last place, elementwise, for float arrays of one dtype and shape (int64)."""
    ua, ub = _unsigned(np.asarray(a)), _unsigned(np.asarray(b))
    return np.abs(_ordered(ua, ua.dtype.itemsize) - _ordered(ub, ub.dtype.itemsize))


def _hex(u) -> str:
    return f"0x{int(u):0{2 * u.dtype.itemsize}x}"


#: Elements compared at a time by `_bytes_equal` (its temporary's size).
EQUAL_CHUNK = 1 << 22


def _bytes_equal(ua: np.ndarray, ub: np.ndarray) -> bool:
    """Whether two unsigned views of one shape hold the same bits, compared a chunk at a time
    (a whole pool leaf's elementwise comparison would be a temporary of its size)."""
    fa, fb = ua.reshape(-1), ub.reshape(-1)
    return all(np.array_equal(fa[i : i + EQUAL_CHUNK], fb[i : i + EQUAL_CHUNK]) for i in range(0, fa.size, EQUAL_CHUNK))


def _rows2d(a: np.ndarray) -> np.ndarray:
    """`a` as [rows, elements] (rows: axis 0; a scalar is one row); empty arrays keep their rows."""
    if a.ndim == 0:
        return a.reshape(1, 1)
    return a.reshape(a.shape[0], int(np.prod(a.shape[1:], dtype=np.int64)))


def diff_part(ref: Part, got: Part, contract: Contract, unjudged: np.ndarray | None = None) -> PartDiff:
    """Compare one part pair element by element under `contract` (see the module invariants).
    `unjudged` (bool, the part's shape as [rows, elements]): elements whose difference is
    reported but not judged; a row with any such element has its argmax not judged either."""
    a, b = ref.data, got.data
    if (ref.name, ref.kind, a.shape, a.dtype) != (got.name, got.kind, b.shape, b.dtype):
        note = {"part": ref.name, "note": f"{ref.name} {a.shape} {a.dtype} vs {got.name} {b.shape} {b.dtype}"}
        rows = max(_rows2d(a).shape[0], _rows2d(b).shape[0])
        return PartDiff(max(a.nbytes, b.nbytes), float("inf"), None, False, note, note, np.ones(rows, bool))
    a2, b2 = _rows2d(a), _rows2d(b)
    ua, ub = _unsigned(a2), _unsigned(b2)
    out = PartDiff(bad_rows=np.zeros(a2.shape[0], bool))
    if _bytes_equal(ua, ub):
        return out
    neq = ua != ub
    out.differing_bytes = int((_unsigned(a).view(np.uint8) != _unsigned(b).view(np.uint8)).sum())
    ints = ref.kind == "tokens"
    fa, fb = a2.astype(np.float64), b2.astype(np.float64)
    absd = np.abs(fa - fb)
    absd[neq & ~np.isfinite(absd)] = np.inf
    absd[~neq] = 0.0
    out.max_abs = float(absd.max())
    ulp = None if ints else ulp_distance(a2, b2)
    if ulp is not None:
        out.max_ulp = int(ulp.max())
    am_a = am_b = None
    if ref.kind == "logits":
        am_a, am_b = fa.argmax(axis=1), fb.argmax(axis=1)
        out.argmax_equal = bool((am_a == am_b).all())
    else:
        out.argmax_equal = not ints

    def where(r: int, c: int, why: str) -> dict:
        d = {
            "part": ref.name,
            "row": r,
            "index": c,
            "reference": a2[r, c].item() if ints else float(fa[r, c]),
            "replay": b2[r, c].item() if ints else float(fb[r, c]),
            "reference_hex": _hex(ua[r, c]),
            "replay_hex": _hex(ub[r, c]),
            "ulp": None if ulp is None else int(ulp[r, c]),
            "abs_diff": float(absd[r, c]),
            "max_abs_diff": out.max_abs,
            "why": why,
        }
        if am_a is not None and am_b is not None:
            d.update(argmax_reference=int(am_a[r]), argmax_replay=int(am_b[r]), argmax_equal=bool(am_a[r] == am_b[r]))
        return d

    r0, c0 = (int(x[0]) for x in np.nonzero(neq))
    out.first = where(r0, c0, "bytes differ")
    tol = 0.0
    if not contract.bounded or ints:
        bad = neq
        why = "bytes differ" if not contract.bounded else "a token differs"
    else:
        tol = contract.tolerance(fa, a.dtype)
        bad = absd > tol
        why = f"|Δ| > {tol:.3g}"
    if unjudged is not None:
        bad = bad & ~unjudged
    bad_rows = bad.any(axis=1)
    if am_a is not None and am_b is not None and contract.bounded:
        flipped = am_a != am_b
        if contract.argmax_gap:
            rows = np.arange(len(am_a))
            flipped &= fa[rows, am_a] - fa[rows, am_b] > tol
        if unjudged is not None:
            flipped &= ~unjudged.any(axis=1)
        bad_rows |= flipped
    out.bad_rows = bad_rows
    if bad_rows.any():
        r = int(np.nonzero(bad_rows)[0][0])
        if bad[r].any():
            out.violation = where(r, int(np.nonzero(bad[r])[0][0]), why)
        else:
            # A row is bad with no bad element only through the argmax rule, so am_b exists.
            assert am_b is not None
            out.violation = where(r, int(am_b[r]), "argmax differs")
    return out


@dataclasses.dataclass(frozen=True)
class Settled:
    """A step's parts compared at the time they were recorded (`state.settle_pools`), so that neither
    side's arrays need be kept: their diffs under `contract`."""

    contract: Contract
    diffs: list[PartDiff]


DRAFTS, CONFIDENCES = "drafts", "confidences"


def draft_logits_name(j: int) -> str:
    """The part of draft position j's logits (j = 1..nd)."""
    return f"draft {j} logits"


def propose_parts(drafts: np.ndarray, confidences: np.ndarray, logits: np.ndarray) -> list[Part]:
    """A propose's outputs as parts: drafts [n, nd] int32, confidences [n, nd] f32 and each draft
    position's logits [n, nd, V] f32, the logits first (`draft j logits` [n, V], j = 1..nd)."""
    n, nd = drafts.shape
    chex.assert_shape(logits, (n, nd, None))
    parts = [Part(draft_logits_name(j + 1), logits[:, j], "logits") for j in range(nd)]
    return parts + [Part(DRAFTS, drafts, "tokens"), Part(CONFIDENCES, confidences, "values")]


def draft_chain_cuts(ref: Sequence[Part], got: Sequence[Part], contract: Contract) -> dict[int, int]:
    """Per sequence (row of the propose parts), the draft index j (0-based) where its greedy draft
    flipped on a near-tie: the reference's draft j is the argmax of its `draft j+1 logits`, the
    replay's draft differs, and the reference's gap between the two is within `contract`'s
    tolerance of that part. Only under `contract.argmax_gap`; a step without a propose: {}."""
    a, b = {p.name: p for p in ref}, {p.name: p for p in got}
    if not contract.argmax_gap or DRAFTS not in a or DRAFTS not in b:
        return {}
    da, db = a[DRAFTS].data, b[DRAFTS].data
    if da.shape != db.shape:
        return {}
    cuts = {}
    for r in np.nonzero((da != db).any(axis=1))[0]:
        j = int(np.nonzero(da[r] != db[r])[0][0])
        logits = a.get(draft_logits_name(j + 1))
        if logits is None or logits.data.ndim != 2:
            continue
        row = logits.data[r].astype(np.float64)
        tol = contract.tolerance(logits.data.astype(np.float64), logits.data.dtype)
        greedy = int(row.argmax()) == int(da[r, j])
        if greedy and 0 <= db[r, j] < row.size and row[da[r, j]] - row[db[r, j]] <= tol:
            cuts[int(r)] = j
    return cuts


_DRAFT_LOGITS = re.compile(r"draft (\d+) logits")


def _unjudged(part: Part, cuts: dict[int, int]) -> np.ndarray | None:
    """The elements of a propose part past each sequence's cut (`draft_chain_cuts`): the drafts
    and confidences from the flipped draft on, the logits of the drafts after it."""
    named = _DRAFT_LOGITS.fullmatch(part.name)
    if not cuts or (named is None and part.name not in (DRAFTS, CONFIDENCES)):
        return None
    mask = np.zeros(_rows2d(part.data).shape, bool)
    for r, j in cuts.items():
        if named is None:
            mask[r, j:] = True
        else:
            mask[r] = int(named.group(1)) > j + 1
    return mask


def diff_parts(
    ref: Sequence[Part], got: Sequence[Part], contract: Contract, cuts: dict[int, int] | None = None
) -> list[PartDiff]:
    """`diff_part` over two part lists; a missing or extra part is a structural violation; a
    propose's draft chains are judged up to their excused flips (`cuts`: `draft_chain_cuts`'s,
    computed here when not given)."""
    cuts = draft_chain_cuts(ref, got, contract) if cuts is None else cuts
    out = [diff_part(x, y, contract, _unjudged(x, cuts)) for x, y in zip(ref, got)]
    for p in list(ref[len(got) :]) + list(got[len(ref) :]):
        where = {"part": p.name, "note": "present on one side only"}
        out.append(PartDiff(p.data.nbytes, float("inf"), None, False, where, where, np.ones(1, bool)))
    return out


@dataclasses.dataclass
class Comparison:
    """A replay against the reference. Byte-level fields (`prefill_equal`, `steps`,
    `mismatched_steps`, `first_mismatch`, `max_mismatched_bytes`); `first_diff` locates
    the first differing element (step, part, row, vocab index, both values in hex, ULP);
    `violating_steps` / `first_violation` say where the contract broke; `ok` is the verdict;
    `excused_draft_flips`: the draft chains judged only up to a near-tie flip (`draft_chain_cuts`)."""

    variant: str
    contract: str
    prefill_equal: bool
    steps: int
    mismatched_steps: int
    first_mismatch: int | None
    max_mismatched_bytes: int
    max_abs_diff: float
    max_ulp: int | None
    argmax_equal: bool
    first_diff: dict | None
    violating_steps: list
    first_violation: dict | None
    ok: bool
    excused_draft_flips: int = 0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def compare(variant: str, reference: Recording, run: Recording, contract: Contract) -> Comparison:
    """`run` against `reference`: the prefill parts, then every step's parts, under `contract`."""
    units: list[tuple[Step, list[Part], list[Part]]] = [("prefill", reference.prefill, run.prefill)]
    units += [(s, a, b) for s, (a, b) in enumerate(zip(reference.steps, run.steps))]
    per_step_bytes: list[int] = []
    violating: list[Step] = []
    first_diff: dict | None = None
    first_violation: dict | None = None
    max_abs, max_ulp, argmax_equal, prefill_equal, excused = 0.0, None, True, True, 0
    for step, a, b in units:
        cuts = draft_chain_cuts(a, b, contract)
        excused += len(cuts)
        diffs = diff_parts(a, b, contract, cuts)
        if isinstance(step, int) and step in run.settled:
            if run.settled[step].contract != contract:
                raise ValueError(
                    f"step {step} was settled under {run.settled[step].contract}, compared under {contract}"
                )
            diffs += run.settled[step].diffs
        nbytes = sum(d.differing_bytes for d in diffs)
        if step == "prefill":
            prefill_equal = nbytes == 0
        else:
            per_step_bytes.append(nbytes)
        for d in diffs:
            max_abs = max(max_abs, d.max_abs)
            if d.max_ulp is not None:
                max_ulp = max(max_ulp or 0, d.max_ulp)
            argmax_equal &= d.argmax_equal
            if first_diff is None and d.first is not None:
                first_diff = {"step": step, **d.first}
            if d.violation is not None and first_violation is None:
                first_violation = {"step": step, **d.violation}
        if any(d.violation is not None for d in diffs):
            violating.append(step)
    if len(reference.steps) != len(run.steps):
        note: dict[str, Any] = {
            "step": min(len(reference.steps), len(run.steps)),
            "note": f"{len(reference.steps)} reference steps, {len(run.steps)} replayed",
        }
        violating.append(note["step"])
        first_violation = first_violation or note
    mismatched = [s for s, n in enumerate(per_step_bytes) if n]
    return Comparison(
        variant=variant,
        contract=contract.describe(),
        prefill_equal=prefill_equal,
        steps=len(per_step_bytes),
        mismatched_steps=len(mismatched),
        first_mismatch=mismatched[0] if mismatched else None,
        max_mismatched_bytes=max(per_step_bytes, default=0),
        max_abs_diff=max_abs,
        max_ulp=max_ulp,
        argmax_equal=argmax_equal,
        first_diff=first_diff,
        violating_steps=violating,
        first_violation=first_violation,
        ok=not violating,
        excused_draft_flips=excused,
    )


def saw_difference(c: Comparison) -> bool:
    """A detection control's pass condition: some byte differed after the prefill."""
    return c.mismatched_steps > 0


def without_rows(run: Recording, rows: Sequence[int]) -> Recording:
    """`run` with rows `rows` (axis 0 of every part) left out, prefill and steps alike."""
    if not rows:
        return run

    def keep(parts):
        return [dataclasses.replace(p, data=np.delete(p.data, list(rows), axis=0)) for p in parts]

    return Recording(keep(run.prefill), [keep(s) for s in run.steps], run.enqueue_ms, run.step_ms)


def median_after_first(xs: Sequence[float]) -> float | None:
    """The median of xs[1:] (step 0 compiles), upper middle; None with fewer than 2 values."""
    v = sorted(xs[1:])
    return v[len(v) // 2] if v else None


def timing(variant: str, run: Recording) -> dict:
    return {
        "variant": variant,
        "enqueue_ms_median": median_after_first(run.enqueue_ms),
        "step_ms_median": median_after_first(run.step_ms),
    }
