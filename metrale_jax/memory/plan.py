"""The memory model: one workload point → every charged term, the verdict, and the inverse queries.

Owns: `Planner` (settings + model + device, evaluated at any (concurrency, ISL, OSL)), the
refusals (settings the engine does not implement, more sequences than slots, longer than
`max_seq_len`), `largest_fitting` (bisection), the two inverse queries (largest concurrency,
longest ISL), and `require_room`: the up-front check of a command about to allocate (an engine's
pools, a cache) against what the local device can still hold.

Invariants:
- No byte count is computed here: pool bytes are the shapes and dtypes `allocate_pool` builds
  (traced abstractly with `jax.eval_shape`), unit counts come from `capacity.pool_counts`,
  weight bytes from `metrale_jax.memory.weights`, activation bytes from XLA's memory analysis of
  the compiled step programs (`metrale_jax.memory.activations`); this module only sums them.
- Every probe of an inverse query is a full evaluation (slots and counts recomputed); its
  activations are compiled once per distinct shape set, or interpolated in the KV block counts
  from its family's compiled anchor (`ActivationModel.at(exact=False)`), and only when the rest
  fits: a probe that does not fit without activations does not fit with them.
- `device_total = weights + pools + activations + runtime reserve` (activations 0 when skipped);
  fits iff `budget − device_total ≥ 0`. Every term is one device's: under a tp x ep mesh
  (`--tensor-parallel-size`, `--expert-parallel-size`) each buffer's shard, from the engine's
  own layout table (`engine.sharding`), and the budget is one device's.
- A planner is never built for settings `engine.settings.unsupported` lists (the engine's own
  refusal), so it never says "fits" for a serve the engine would not start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from metrale_jax.config import ModelConfig
from metrale_jax.engine import pool, sharding
from metrale_jax.engine.capacity import AUTO_MAX_SLOTS, PoolCounts, pool_counts
from metrale_jax.engine.settings import EngineSettings, unsupported
from metrale_jax.memory.activations import ActivationModel, Activations
from metrale_jax.memory.devices import Device, local_memory, mib, runtime_reserve, util_budget
from metrale_jax.memory.errors import PlanError


@dataclasses.dataclass(frozen=True)
class Term:
    """One charged allocation (or a fold of `count` alike ones): its bytes, dtype, shape."""

    name: str
    group: str
    bytes: int
    dtype: str = ""
    shape: tuple[int, ...] = ()
    count: int = 1


@dataclasses.dataclass(frozen=True)
class Workload:
    """`concurrency` sequences of `isl` prompt + `osl` output tokens."""

    concurrency: int
    isl: int
    osl: int

    @property
    def tokens(self) -> int:
        return self.isl + self.osl


class Refused(PlanError):
    """A workload the serve cannot run at all (not a memory verdict)."""


class TooLarge(PlanError):
    """A request whose allocations would not fit the local device (said before allocating)."""


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """Every term at one workload point, and the verdict against the budget."""

    workload: Workload
    settings: EngineSettings
    counts: PoolCounts
    weights: tuple[Term, ...]
    pools: tuple[Term, ...]
    budget: int
    runtime: int
    activations: Activations | None = None

    @property
    def activation_bytes(self) -> int:
        """The charged activation figure (the peak step program); 0 when not computed."""
        return self.activations.bytes if self.activations is not None else 0

    @property
    def weight_bytes(self) -> int:
        return sum(t.bytes for t in self.weights)

    @property
    def pool_bytes(self) -> int:
        return sum(t.bytes for t in self.pools)

    @property
    def device_total(self) -> int:
        return self.weight_bytes + self.pool_bytes + self.activation_bytes + self.runtime

    @property
    def headroom(self) -> int:
        return self.budget - self.device_total

    @property
    def fits(self) -> bool:
        return self.headroom >= 0

    def groups(self) -> dict[str, int]:
        """Pool bytes per group, largest first."""
        out: dict[str, int] = {}
        for t in self.pools:
            out[t.group] = out.get(t.group, 0) + t.bytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def growth(before: Evaluation, after: Evaluation) -> tuple[str, int, int]:
    """Between two evaluations: `(the pool group, or "activations", that grew most, its growth,
    total growth)`."""
    a = {**before.groups(), "activations": before.activation_bytes}
    b = {**after.groups(), "activations": after.activation_bytes}
    deltas = {g: b.get(g, 0) - a.get(g, 0) for g in {*a, *b}}
    group = max(sorted(deltas), key=lambda g: deltas[g])
    return group, deltas[group], after.device_total - before.device_total


def largest_fitting(lo: int, hi: int, fits: Callable[[int], bool]) -> int | None:
    """The largest `n` in `lo..=hi` with `fits(n)`, assuming `fits` is monotone (true up to some
    point, false after). None when `fits(lo)` is false; `hi` when `fits(hi)` is true."""
    if lo > hi or not fits(lo):
        return None
    if fits(hi):
        return hi
    good, bad = lo, hi
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


#: The report group of each engine buffer (a pool missing here is its own group): the groups
#: are what "binds" and the totals speak of.
POOL_GROUPS = {
    "trunk.gdn_h": "recurrent state",
    "trunk.gdn_conv": "recurrent state",
    "trunk.kv_k": "kv cache",
    "trunk.kv_v": "kv cache",
    "trunk.verify_h": "verify rows",
    "trunk.verify_conv": "verify rows",
    "trunk.ckpt_h": "verify checkpoints",
    "trunk.ckpt_conv": "verify checkpoints",
    "draft_k": "mtp drafter kv",
    "draft_v": "mtp drafter kv",
    "stash": "hidden stash",
    "snap_h": "prefix snapshots",
    "snap_conv": "prefix snapshots",
    "snap_stash": "prefix snapshots",
    "snap_draft_k": "prefix snapshots",
    "snap_draft_v": "prefix snapshots",
    "draft_probs": "mtp drafter laws",
}


def pool_terms(config: ModelConfig, counts: PoolCounts, settings: EngineSettings, dtype: Any) -> tuple[Term, ...]:
    """The engine's buffers for `counts`, exactly as `allocate_pool` builds them (traced
    abstractly), one term each, named by the engine's `POOL_LABELS`: per device under the
    settings' tp x ep mesh (`sharding.abstract_pool`: each term is one device's shard, its shape
    the shard's)."""
    shapes = sharding.abstract_pool(config, counts, settings, dtype=dtype, mesh=sharding.planning_mesh(settings))
    leaves = jax.tree_util.tree_leaves(shapes)
    return tuple(
        Term(pool.POOL_LABELS.get(name, name), POOL_GROUPS.get(name, name), sharding.device_bytes(x), dt, _shard(x))
        for (name, _, dt, _), x in zip(pool.pool_buffers(shapes), leaves)
    )


def _shard(x) -> tuple[int, ...]:
    """One device's shape of a (sharded) shape struct."""
    s = getattr(x, "sharding", None)
    return tuple(s.shard_shape(tuple(x.shape))) if s is not None else tuple(x.shape)


@dataclasses.dataclass(frozen=True)
class Planner:
    """A serve (`settings`, the resolved base) of a model on a device, evaluable at any workload.

    `slots`: the `--slots` what-if (an int, "auto" to follow the concurrency, or None to follow
    `--max-batch-size`); `follow_auto` says the serve asked for `--max-batch-size auto`.
    `pools` computes the pool terms (the engine's allocator; replaceable in tests).
    `activations`: the step programs' activation model (None: activations not computed).
    """

    config: ModelConfig
    settings: EngineSettings
    device: Device
    dtype: Any
    weights: tuple[Term, ...]
    slots: int | str | None = None
    follow_auto: bool = False
    pools: Callable[[ModelConfig, PoolCounts, EngineSettings, Any], tuple[Term, ...]] = pool_terms
    activations: ActivationModel | None = None

    def __post_init__(self):
        refused = unsupported(self.settings, self.config)
        if refused:
            raise Refused("the engine would refuse this serve, not supported: " + "; ".join(refused))

    @property
    def slots_follow_concurrency(self) -> bool:
        """True when each workload gets as many slots as it has sequences."""
        return self.slots == "auto" or (self.slots is None and self.follow_auto)

    def slots_for(self, concurrency: int) -> int:
        """Sequence slots at `concurrency`: `--slots N`, else the concurrency when slots follow
        it, else `--max-batch-size`."""
        if isinstance(self.slots, int):
            return self.slots
        return concurrency if self.slots_follow_concurrency else self.settings.max_batch_size

    @property
    def budget(self) -> int:
        return util_budget(self.device, self.settings.gpu_memory_utilization)

    def refusal(self, w: Workload) -> str | None:
        """Why the serve cannot run `w` at all, or None."""
        slots = self.slots_for(w.concurrency)
        if w.concurrency > slots:
            return f"{w.concurrency} sequences need {w.concurrency} slots; the serve has {slots}"
        if slots > AUTO_MAX_SLOTS:
            return f"{slots} slots exceed the widest batch, {AUTO_MAX_SLOTS}"
        if w.tokens > self.settings.max_seq_len:
            return f"ISL + OSL = {w.tokens} tokens exceeds --max-seq-len {self.settings.max_seq_len}"
        return None

    def evaluate(self, w: Workload, *, exact: bool = True, activations: bool = True) -> Evaluation:
        """Every term at `w`. Raises Refused when the serve cannot run `w`.

        `exact`: compile the step programs at `w`'s own shapes (unless known); False (a probe)
        lets a probe of an already-compiled family be interpolated in the KV block counts.
        `activations=False`: leave the activations out (None), whatever the planner's model."""
        reason = self.refusal(w)
        if reason is not None:
            raise Refused(reason)
        settings = dataclasses.replace(self.settings, max_batch_size=self.slots_for(w.concurrency))
        counts = pool_counts(settings, self.config, tokens_per_seq=w.tokens)
        budget = self.budget
        return Evaluation(
            workload=w,
            settings=settings,
            counts=counts,
            weights=self.weights,
            pools=self.pools(self.config, counts, settings, self.dtype),
            budget=budget,
            runtime=runtime_reserve(budget),
            activations=(
                self.activations.at(settings, counts, exact=exact)
                if activations and self.activations is not None
                else None
            ),
        )

    def probe(self, w: Workload) -> Evaluation:
        """`evaluate(w, exact=False)`: the evaluation an inverse query's probe sees."""
        return self.evaluate(w, exact=False)

    def fits(self, w: Workload) -> bool:
        """`w` is runnable and its evaluation fits the budget. Activations are never negative: a
        probe whose other terms alone exceed the budget does not fit, and its step programs are
        not compiled."""
        if self.refusal(w) is not None:
            return False
        return self.evaluate(w, exact=False, activations=False).fits and self.probe(w).fits

    def widest_concurrency(self, concurrency: int) -> int:
        """The top of the max-concurrency search: 128 when slots follow the concurrency, else
        the serve's slots."""
        return AUTO_MAX_SLOTS if self.slots_follow_concurrency else self.slots_for(concurrency)

    def max_concurrency(self, isl: int, osl: int, concurrency: int) -> int | None:
        """The most sequences of `isl + osl` tokens that fit (None: not even one)."""
        return largest_fitting(1, self.widest_concurrency(concurrency), lambda c: self.fits(Workload(c, isl, osl)))

    def max_isl(self, concurrency: int, osl: int) -> int | None:
        """The longest prompt that fits at `concurrency` sequences and `osl` output tokens."""
        hi = max(self.settings.max_seq_len - osl, 1)
        return largest_fitting(1, hi, lambda isl: self.fits(Workload(concurrency, isl, osl)))


def allocation_terms(group: str, allocate: Callable[[], Any]) -> tuple[Term, ...]:
    """The buffers `allocate()` creates, traced with `jax.eval_shape` (nothing is allocated),
    one term each in `group`, named by their path in its result."""
    shapes = jax.eval_shape(allocate)
    return tuple(Term(name, group, size, dt, shape) for name, shape, dt, size in pool.pool_buffers(shapes))


def serve_pools(config: ModelConfig, settings: EngineSettings, dtype: Any) -> tuple[Term, ...]:
    """The pool terms of an `Engine(config, params, settings)` as it allocates them (the
    planner's own `pool_terms` at the serve's full `pool_counts`)."""
    return pool_terms(config, pool_counts(settings, config), settings, dtype)


def require_room(what: str, terms: tuple[Term, ...], hint: str) -> None:
    """Raise TooLarge when `terms` (the allocations `what` is about to make) exceed what the
    local device can still hold, naming the total, the largest terms, the room and `hint`."""
    need = sum(t.bytes for t in terms)
    room, where = local_memory()
    if need <= room:
        return
    top = ", ".join(f"{t.name} {mib(t.bytes)}" for t in sorted(terms, key=lambda t: -t.bytes)[:3])
    raise TooLarge(f"{what} needs {mib(need)} ({top}) but {where} has {mib(room)} free: {hint}")
