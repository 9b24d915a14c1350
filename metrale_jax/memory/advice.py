"""What the planner tells the operator beyond the totals: the inverse answers and the warnings.

Owns: `Answer` (an inverse query's value and why it stops there) and `warnings_for` (settings
that silently do nothing, or do less than asked, at this workload).

Invariants:
- Answers come only from full evaluations (`Planner.max_concurrency` / `max_isl`); the
  "binds" note compares the last fitting point with the first failing one.
- A warning never changes a number; it only explains one.
"""

from __future__ import annotations

import dataclasses

from metrale_jax.engine.capacity import ladder_drafts
from metrale_jax.engine.settings import RULE_FLAG, EngineSettings
from metrale_jax.memory.devices import mib
from metrale_jax.memory.plan import Evaluation, Planner, Workload, growth


@dataclasses.dataclass(frozen=True)
class Answer:
    """An inverse query's result (None: nothing fits) and a one-line explanation."""

    value: int | None
    note: str


def _binding_note(before: Evaluation, after: Evaluation, step: str) -> str:
    group, delta, total = growth(before, after)
    return f"binds: {group} ({step} adds {mib(total)}, {mib(delta)} of it {group}; headroom then {mib(after.headroom)})"


def concurrency_answer(planner: Planner, w: Workload) -> Answer:
    """The most sequences of `w.isl + w.osl` tokens that fit, and what stops one more."""
    widest = planner.widest_concurrency(w.concurrency)
    n = planner.max_concurrency(w.isl, w.osl, w.concurrency)
    if n is None:
        one = planner.probe(Workload(1, w.isl, w.osl))
        return Answer(None, f"one sequence needs {mib(one.device_total)} of a {mib(one.budget)} budget")
    if n == widest:
        why = (
            "the widest batch"
            if planner.slots_follow_concurrency
            else "the serve's slots; each slot's pools are allocated whatever the load"
        )
        return Answer(n, f"the search stops at {widest}, {why}")
    before = planner.probe(Workload(n, w.isl, w.osl))
    after = planner.probe(Workload(n + 1, w.isl, w.osl))
    return Answer(n, _binding_note(before, after, f"sequence {n + 1}"))


def isl_answer(planner: Planner, w: Workload) -> Answer:
    """The longest prompt that fits at `w.concurrency` and `w.osl`, and what stops a longer one."""
    hi = max(planner.settings.max_seq_len - w.osl, 1)
    n = planner.max_isl(w.concurrency, w.osl)
    if n is None:
        return Answer(None, "not even a 1-token prompt fits")
    if n == hi:
        return Answer(n, f"every prompt up to --max-seq-len − OSL = {hi} fits")
    before = planner.probe(Workload(w.concurrency, n, w.osl))
    after = planner.probe(Workload(w.concurrency, n + 1, w.osl))
    return Answer(n, _binding_note(before, after, f"ISL {n + 1}"))


def _explicit(settings: EngineSettings, flag: str) -> bool:
    return any(p.setting == flag and p.rule.startswith(RULE_FLAG) for p in settings.provenance)


def warnings_for(planner: Planner, ev: Evaluation) -> tuple[str, ...]:
    """Settings that silently do nothing (or less than asked) for `ev`'s workload."""
    s, c, w = ev.settings, ev.counts, ev.workload
    out = []
    if s.ssm_cache_slots > 0 and not s.enable_prefix_caching and _explicit(s, "--ssm-cache-slots"):
        out.append(
            f"--ssm-cache-slots {s.ssm_cache_slots} does nothing without "
            "--enable-prefix-caching (no snapshot slots are allocated)"
        )
    if s.enable_prefix_caching and c.snapshot_slots == 0:
        out.append(
            "--enable-prefix-caching with --ssm-cache-slots 0 keeps no recurrent-state snapshot: "
            "no prefill ever restores"
        )
    if s.block_size > w.isl:
        out.append(
            f"--block-size {s.block_size} exceeds the ISL {w.isl}: a prompt never fills "
            "a KV block, so prefix caching can share none of it"
        )
    if not s.speculative and _explicit(s, "--num-drafts"):
        out.append("--num-drafts does nothing without --speculative")
    if s.speculative:
        if w.concurrency > c.mtp_slots:
            out.append(
                f"concurrency {w.concurrency} is above the {c.mtp_slots} MTP verify "
                f"slots: sequences on slots {c.mtp_slots} and up decode without drafts"
            )
        drafts = ladder_drafts(min(w.concurrency, s.mtp_max_seqs), s.num_drafts, s.k_ladder)
        if drafts < s.num_drafts:
            out.append(
                f"at {w.concurrency} active sequences the K ladder allows {drafts} "
                f"draft(s) per verify, not the {s.num_drafts} asked for"
            )
    if c.real_slots > w.concurrency and not planner.slots_follow_concurrency:
        out.append(
            f"the serve holds {c.real_slots} slots for a concurrency of "
            f"{w.concurrency}: {c.real_slots - w.concurrency} slots' pools sit idle"
        )
    util = s.gpu_memory_utilization
    act = ev.activations
    if act is not None and act.backend != "gpu":
        out.append(
            f"activations are XLA's analysis of the step programs compiled for "
            f"{act.label}, not for {planner.device.id}: scratch differs between backends"
        )
    if util > planner.device.util_ceiling:
        out.append(
            f"--gpu-memory-utilization {util} is above {planner.device.id}'s ceiling "
            f"{planner.device.util_ceiling}"
            + (" (unified memory: the host shares it)" if planner.device.unified else "")
        )
    return tuple(out)
