"""The forwards a diff compares, what each promises, and the replay of all of them.

Owns: `Variant` (report label, engine forward name, step path, contract), the reference (`xla`),
`default_variants` (`xla-repeat`, `fused`, then every other forward the engine has, each either
available or reported unavailable with the reason), `applicable` (which variants a mode runs),
`replay_all` / `compare_all` (one replay per variant, judged against the reference run) and
`disclosed` (what each forward compiled).

Invariants:
- `xla-repeat` runs the reference's own compiled programs, so it is declared bit-identical:
  any byte it changes is run-to-run nondeterminism.
- `fused` runs the reference forward's fused speculative step (`Engine.speculative_step`) in
  lock-step with the composed transitions, each step from one pool (`verify.run_fused`); it is
  declared bit-identical (the fused program runs the same transitions, fenced from each other by
  optimization barriers) and runs in the verify modes of a snapshot-rollback engine only.
- `oracle` replays the reference's committed tokens through the plain path only (`diff.oracle`):
  bounded (`oracle.oracle_contract`, set by `applicable` for the engine); it runs in the verify
  modes and `--swap` (there: a run that never spilled, bit-identical).
- Under `--batch-invariant` another forward (`pallas`) runs its kernels' batch-invariant configuration
  interpreted, bounded by `OTHER_FORWARD_RTOL` (`INVARIANT_KERNELS_CONTRACT`). Otherwise it is declared
  bounded: by `INTERPRETED_RTOL` where its kernels run under the Pallas interpreter (CPU: each kernel
  is byte-equal to its reference twin at the kernel tests' shapes, but XLA CPU contracts some
  multiply-adds into FMAs in a kernel body and not in the twin's fusions at some batch widths: a few
  ULP), by `OTHER_FORWARD_RTOL` where they are compiled (Triton: other reduction order).
- A mesh variant (`tp2`, `tp2-ep2`) replays the reference's steps with the reference forward on
  the engine resharded over a (tp, ep) mesh (`Engine.set_mesh`): the partitioned products and
  all-reduces sum in another order, so it is declared bounded (`MESH_RTOL`); it runs only when
  asked for by name (the devices decide whether it can) and not in the swap mode (a sharded
  record holds the conv channels group-major).
- Every function leaves the reference forward selected, on the engine's own mesh, when it
  returns or raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

import jax

from metrale_jax.diff.compare import BIT_IDENTICAL, Comparison, Contract, Recording, bounded, compare, timing
from metrale_jax.diff.oracle import ORACLE, ORACLE_CONTRACT, oracle_contract
from metrale_jax.engine.engine import FORWARDS, make_ops
from metrale_jax.engine.sharding import make_mesh

REFERENCE = "xla"
#: The declared bound of a forward with compiled kernels (f32 logits): another reduction order
#: moves logits by rounding-level amounts, far inside it, while an indexing or state bug,
#: which moves logits by O(1), stays far outside it.
OTHER_FORWARD_RTOL = 1e-3
#: The declared bound of a forward whose kernels run under the Pallas interpreter: its values are the
#: twins' but for FMA contraction (the seed's verify batches of 5 sequences: |Δ| up to 2.4e-6 on tiny,
#: 1.4e-5 on the qwen3_next_moe fixture; BUILD_NOTES' Known issues); an indexing or state bug moves
#: logits by O(1), far outside it.
INTERPRETED_RTOL = 1e-5


#: Another forward's contract under `--batch-invariant`: its kernels' batch-invariant configuration runs
#: interpreted (the mode runs on CPU only; `kernels_pallas.ops.PallasInvariantOps`). The rows and attention
#: kernels are their invariant twins' arithmetic bit for bit, but the chunk kernel's 2-D dots round as its
#: twin's batched ones only at some dims (the qwen3_next_moe fixture, dv 12: the prefill's logits 1 ULP apart,
#: then the drafter's confidences 2.4e-5 apart where `INTERPRETED_RTOL` allows 2.0e-5), so against the xla forward
#: it is bounded as another forward's kernels are; its own batch invariance is the contract's, bit for bit
#: (tests/test_batch_invariant.py, `tiny-f32-pallas`). On tiny the variant is bit-identical.
INVARIANT_KERNELS_CONTRACT = bounded(
    OTHER_FORWARD_RTOL, "--batch-invariant, the kernels' invariant configuration: the chunk kernel's dots at some dims"
)

#: The declared bound of a sharded replay: its partitioned sums round in another order, as compiled
#: kernels do (an fp8 KV cache turns a last-bit change of a K or V value into an fp8 step).
MESH_RTOL = OTHER_FORWARD_RTOL
#: Mesh variants: label -> (tensor-parallel size, expert-parallel size).
MESH_VARIANTS = {"tp2": (2, 1), "tp2-ep2": (2, 2)}

#: The label of the fused speculative step's variant.
FUSED = "fused"
#: The modes the fused step's variant runs in.
FUSED_MODES = ("verify", "verify-batch")
#: The modes the oracle runs in (elsewhere the reference already is the plain path, and
#: `--prefill` compares every chunking with the one-pass prefill).
ORACLE_MODES = ("verify", "verify-batch", "swap")


@dataclasses.dataclass(frozen=True)
class Variant:
    """label: the report's name; forward: the name `Engine.set_forward` takes; step: how a verify
    step runs (`composed`: the reference's transitions one by one, replayed; `fused`: the fused
    step, in lock-step with the composed transitions); mesh: (tp, ep) to replay on the engine
    resharded over that mesh, None for the engine's own placement."""

    label: str
    forward: str
    contract: Contract = BIT_IDENTICAL
    step: Literal["composed", "fused", "oracle"] = "composed"
    mesh: tuple[int, int] | None = None


def default_variants(names: Iterable[str] | None = None) -> tuple[list[Variant], list[dict]]:
    """(variants, unavailable): `xla-repeat`, `fused`, `oracle` and every non-reference engine forward,
    optionally restricted to the labels in `names`; a forward whose ops cannot be built is
    reported as {name, reason} instead (e.g. its kernels fail to import)."""
    wanted = None if names is None else set(names)
    variants, unavailable = [], []
    for label in known_labels():
        if wanted is not None and label not in wanted:
            continue
        if label == FUSED:
            variants.append(Variant(FUSED, REFERENCE, BIT_IDENTICAL, step="fused"))
            continue
        if label == ORACLE:
            variants.append(Variant(ORACLE, REFERENCE, ORACLE_CONTRACT, step="oracle"))
            continue
        if label in MESH_VARIANTS:
            tp, ep = MESH_VARIANTS[label]
            if wanted is None:
                continue
            if tp * ep > len(jax.devices()):
                unavailable.append({"name": label, "reason": f"needs {tp * ep} devices, {len(jax.devices())} present"})
                continue
            contract = bounded(MESH_RTOL, f"sharded over tp {tp} x ep {ep}: partitioned sums")
            variants.append(Variant(label, REFERENCE, contract, mesh=(tp, ep)))
            continue
        forward = REFERENCE if label == "xla-repeat" else label
        try:
            ops = make_ops(forward)
        except Exception as e:  # an unimportable or unbuildable forward is reported, not fatal
            unavailable.append({"name": label, "reason": f"{type(e).__name__}: {e}"})
            continue
        if forward == REFERENCE:
            contract = BIT_IDENTICAL
        elif getattr(ops, "interpret", True):
            contract = bounded(INTERPRETED_RTOL, "interpreted kernels: the twins' values but for FMA contraction")
        else:
            contract = bounded(OTHER_FORWARD_RTOL, "compiled kernels, other reduction order")
        variants.append(Variant(label, forward, contract))
    return variants, unavailable


def known_labels() -> list[str]:
    return ["xla-repeat", FUSED, ORACLE] + [f for f in FORWARDS if f != REFERENCE] + list(MESH_VARIANTS)


def applicable(engine, mode: str, variants: Sequence[Variant]) -> tuple[list[Variant], list[dict]]:
    """(the variants `mode` runs on `engine`, {name, reason} of those it cannot run): the fused
    step's variant runs only in the verify modes, on a snapshot-rollback engine; the oracle in
    `ORACLE_MODES`, under the contract of `engine` (`oracle.oracle_contract`; in `--swap`
    bit-identical: a sequence that never spilled runs the spilled one's programs)."""
    runs, skipped = [], []
    for v in variants:
        if v.step == "oracle":
            v = dataclasses.replace(v, contract=BIT_IDENTICAL if mode == "swap" else oracle_contract(engine))
        if v.step == "oracle" and mode not in ORACLE_MODES:
            why = "--prefill compares every chunking with the one-pass prefill" if mode == "prefill" else None
            reason = why or "the reference of this mode is the plain path already"
            skipped.append(
                {"name": v.label, "reason": f"the oracle runs in --verify, --verify-batch and --swap ({reason})"}
            )
        elif v.step == "fused" and mode not in FUSED_MODES:
            skipped.append({"name": v.label, "reason": "the fused speculative step runs in --verify / --verify-batch"})
        elif v.step == "fused" and engine.replay:
            skipped.append({"name": v.label, "reason": "the fused speculative step needs snapshot rollback"})
        elif v.forward not in (None, "xla") and getattr(engine.settings, "batch_invariant", False):
            runs.append(dataclasses.replace(v, contract=INVARIANT_KERNELS_CONTRACT))
        elif v.mesh is not None and getattr(engine.settings, "batch_invariant", False):
            skipped.append({"name": v.label, "reason": "--batch-invariant runs on one device"})
        elif v.mesh is not None and mode == "swap":
            skipped.append({"name": v.label, "reason": "a sharded record holds the conv channels group-major"})
        else:
            runs.append(v)
    return runs, skipped


@contextlib.contextmanager
def selected(engine, forward: str, mesh: tuple[int, int] | None = None):
    """Select `forward` (and, given `mesh` = (tp, ep), that mesh: `Engine.set_mesh`) for the block;
    the reference forward on the engine's own mesh is selected again afterwards."""
    own = engine.mesh
    engine.set_forward(forward)
    try:
        if mesh is not None:
            engine.set_mesh(make_mesh(engine.cfg, *mesh))
        yield
    finally:
        engine.set_forward(REFERENCE)
        if engine.mesh is not own:
            engine.set_mesh(own)


def replay_all[T](engine, variants: Sequence[Variant], replay: Callable[[], T]) -> list[T]:
    """`replay()` once under each variant's forward, in order: one result per variant."""
    runs = []
    for v in variants:
        with selected(engine, v.forward, v.mesh):
            runs.append(replay())
    return runs


def compare_all(
    variants: Sequence[Variant], reference: Recording, runs: Sequence[Recording]
) -> tuple[list[Comparison], list[dict]]:
    """Each variant's run against `reference` under its contract: (comparisons, timings), the
    reference's timing first."""
    comparisons = [compare(v.label, reference, r, v.contract) for v, r in zip(variants, runs)]
    return comparisons, [timing(REFERENCE, reference)] + [timing(v.label, r) for v, r in zip(variants, runs)]


def disclosed(engine, variants: Sequence[Variant], unavailable: Sequence[dict]) -> list[dict]:
    """The report's variants: the reference, each variant with its step path, its contract and
    what its forward compiled (plan digest, launches per step, program count, the shapes its
    kernels refused), then the unavailable."""
    out = []
    rows = [(REFERENCE, REFERENCE, None, "composed", None)] + [
        (v.label, v.forward, v.contract, v.step, v.mesh) for v in variants
    ]
    for label, forward, contract, step, mesh in rows:
        d = engine.disclosure(forward) if mesh is None else engine.disclosure(forward, make_mesh(engine.cfg, *mesh))
        out.append(
            {
                "name": label,
                "forward": forward,
                "step": step,
                "available": True,
                "contract": "reference" if contract is None else contract.describe(),
                "plan_digest": d["plan_digest"],
                "launches_per_step": d["launches_per_step"],
                "programs": len(d["programs"]),
                "refusals": d.get("refusals", []),
            }
        )
    return out + [{"name": u["name"], "available": False, "reason": u["reason"]} for u in unavailable]
