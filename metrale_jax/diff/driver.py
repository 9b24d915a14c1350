"""`run_diff`: one diff request on one engine, against a list of variants, to a report.

Owns: the warm-up (`diff_programs`: the part of the engine's program list a request runs, compiled
for the reference forward before the first step), the dispatch of a request
to its mode driver, the report's common fields (mode, steps, provenance, the engine's settings,
the variants with their disclosure, the warm-up's seconds and the programs compiled after it)
the verdict and the memory it held (`footprint`: one copy of the weights and one pool, whichever
variants ran, and the process's peak resident set).

The engine is a parameter (built by the command, or by a test that injects a subclass) and so
are the variants (the command passes `default_variants()`; tests add planted-bug forwards).

Invariants:
- The verdict is PASS exactly when `reasons` is empty.
- The reference forward is selected again when `run_diff` returns or raises, and no sequence is
  left allocated (each run frees its own).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import jax
import jaxlib

from metrale_jax import runtime_env
from metrale_jax.diff.decode import diff_prompts, diff_swap, diff_widths
from metrale_jax.diff.footprint import footprint
from metrale_jax.diff.generate import GENERATE_WIDTH, diff_generate
from metrale_jax.diff.prefill import diff_prefill
from metrale_jax.diff.progress import SILENT, Progress
from metrale_jax.diff.request import DiffRequest, DiffRequestError
from metrale_jax.diff.variants import REFERENCE, Variant, applicable, disclosed
from metrale_jax.diff.verify import diff_verify, verify_plan
from metrale_jax.engine.capacity import bucket_width
from metrale_jax.engine.program_list import Program


def provenance(engine) -> dict:
    """What the bytes depend on besides the model: versions, backend, XLA flags, threads,
    dtypes, and every engine setting with the rule that set it."""
    return {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "cpu_threads": runtime_env.allowed_cores(),
        "dtype": str(engine.dtype),
        "settings": [
            {"setting": p.setting, "requested": p.requested, "effective": p.effective, "rule": p.rule}
            for p in engine.settings.provenance
        ],
    }


def diff_programs(engine, request: DiffRequest) -> Callable[[Program], bool]:
    """Which of the engine's programs (`program_list.serve_programs`, with the logits twins) the
    request runs: every prefill bucket and, at the widths of its batches (`bucket_width`), every
    program but the proposes and fused steps it never asks for (a propose of the settings'
    drafts with `--mtp`; the fused step only logits-returning, proposing those drafts or none).
    NOTE: the batches' widths only: a run over fewer sequences (the oracle's) compiles its
    program when it first runs, which the report counts."""
    widths = {bucket_width(n) for n in request.batch or request.verify_batch or (1,)}
    if request.generate:  # the scheduler runs every width its sequences finish through
        widths = {bucket_width(n) for n in range(1, GENERATE_WIDTH + 1)}
    nd = engine.settings.num_drafts if request.mtp or request.generate else 0

    def keep(p: Program) -> bool:
        if p.name == "prefill":
            return True
        drafts, logits = getattr(p.static, "num_drafts", nd), getattr(p.static, "logits", True)
        if p.name in ("propose", "speculative") and not (drafts == nd and logits):
            return False
        return p.width in widths or p.name in ("read_state", "write_state")

    return keep


def warm_up(engine, request: DiffRequest, progress: Progress) -> float:
    """Compile `diff_programs` for the reference forward; returns the wall seconds. The variants'
    forwards compile as they replay (a kernel forward's programs cost most under the Pallas
    interpreter, and a replay runs fewer of them than the list holds)."""
    engine.set_forward(REFERENCE)
    return engine.warm_up(progress, diff_programs(engine, request), logits=True, samples=request.sampling is not None)


def run_diff(
    engine,
    request: DiffRequest,
    variants: Sequence[Variant],
    unavailable: Sequence[dict] = (),
    progress: Progress = SILENT,
) -> dict:
    """Run `request` on `engine`: the reference forward, then each of `variants` replaying it.
    `unavailable` lists forwards that could not run ({name, reason}), reported as such, as are
    the variants this mode does not run (`variants.applicable`).
    Raises DiffRequestError for a request the engine cannot serve; returns the report."""
    request.check()
    request.check_engine(engine)
    variants, skipped = applicable(engine, request.mode, variants)
    unavailable = [*unavailable, *skipped]
    if not variants:
        raise DiffRequestError(
            "no forward to compare with the reference"
            + "".join(f"; {u['name']} is unavailable: {u['reason']}" for u in unavailable)
        )
    r, t0 = request, time.perf_counter()
    warm_seconds = warm_up(engine, request, progress)
    warmed = engine.programs.compilations
    try:
        if r.mode == "default":
            fields, reasons = diff_prompts(engine, variants, n_prompts=r.prompts, steps=r.steps, progress=progress)
        elif r.mode == "batch":
            fields, reasons = diff_widths(
                engine, variants, widths=r.batch, fragment=r.fragment_slots, steps=r.steps, progress=progress
            )
        elif r.mode in ("verify", "verify-batch"):
            plan = verify_plan(
                engine,
                single_ks=r.verify,
                widths=r.verify_batch,
                ks=r.verify_batch_ks,
                fragment=r.layout(engine.settings.k_ladder),
            )
            fields, reasons = diff_verify(
                engine,
                variants,
                plan,
                steps=r.steps,
                fragment=r.layout(engine.settings.k_ladder),
                mtp=r.mtp,
                progress=progress,
                single=r.mode == "verify",
                sampling=r.sampling,
            )
        elif r.mode == "prefill":
            fields, reasons = diff_prefill(
                engine, variants, lengths=r.prefill, chunks=r.prefill_chunk, progress=progress
            )
        elif r.mode == "generate":
            fields, reasons = diff_generate(engine, steps=r.steps, confidence_stop=r.confidence_stop, progress=progress)
        else:
            fields, reasons = diff_swap(engine, variants, steps=r.steps, progress=progress)
    finally:
        engine.set_forward(REFERENCE)
        progress.close()
    return {
        "mode": r.mode,
        "graphs": "jit",
        "steps": r.steps,
        **({} if r.sampling is None else {"sampling": r.sampling.describe()}),
        **({"vocab_stress": True} if r.vocab_stress else {}),
        "provenance": provenance(engine),
        "variants": disclosed(engine, variants, unavailable),
        **fields,
        "verdict": "FAIL" if reasons else "PASS",
        "reasons": reasons,
        "wall_s": round(time.perf_counter() - t0, 3),
        "warmup_s": round(warm_seconds, 3),
        "compiled_after_warmup": engine.programs.compilations - warmed,
        "memory": footprint(engine),
    }
