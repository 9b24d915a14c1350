"""Feed-forward blocks: the dense SwiGLU MLP and the sparse MoE block with a gated shared expert.

Owns: `moe_form` (which of the MoE's three forms a step of a given row count runs), the three
forms of the routed experts, and which models hold their expert stacks one leaf per expert
(`expert_leaves_apply`, `split_expert_stacks`, `join_expert_stacks`).

Invariants:
- The router softmax is float32; top-k weights are renormalised when the config says so (always
  for Qwen3.5-MoE) and cast back to the activation dtype; the block output is
  routed + sigmoid(shared gate) * shared, with no routed scaling factor.
- Every form sums a row's selected experts in expert-index order, each expert's output times its
  routing weight, in the activation dtype: transformers' eager loop, (0 + w_a y_a) + w_b y_b for
  experts a < b. The forms differ only inside the matrix products.
- A row's output is a function of that row alone: no form lets one row's values (a padding row's
  NaN included) reach another row's output.
- The form is a function of the static shape, so one program always runs one form.
- Under a mesh the experts are split over every device (`EXPERT_AXES`); each device runs its own
  and the routed outputs are summed over the devices (the only change: that sum's order).
- No form materialises a layer's expert weights: `dense` and `grouped` contract the whole
  [E, ...] leaves in place (batched over experts, or expert by expert over `ExpertLeaves`);
  `pairs` runs the one selected expert of each loop step, reading its leaf in place through a
  `lax.switch` over `ExpertLeaves`, or copying it out of an [E, ...] stack (on XLA CPU a product's
  operand is a buffer of its own, so a slice that feeds one is materialised).
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from kernels_pallas.reductions import fenced, ordered_sum, pairwise_sum
from metrale_jax.config import ModelConfig
from metrale_jax.model.invariant import products_invariant
from metrale_jax.model.linear import (
    EXPERT_AXES,
    ExpertLeaves,
    linear,
    linear_all_experts,
    linear_parts,
    linear_per_expert,
    mesh_devices,
    with_expert,
)
from metrale_jax.params import dense_in_rows, moe_router_rows, shared_in_rows

MoeForm = Literal["dense", "pairs", "grouped"]

# `dense` whenever every expert on every row is at most this many multiply-adds (small models, where a
# step's few fused products cost less than the other forms' loops, sorts and scatters).
DENSE_MAX_MACS = 1 << 21
# `grouped` when the experts get at least this many (row, expert) pairs each on average.
GROUPED_MIN_PAIRS_PER_EXPERT = 8
# `dense` only up to this many experts (it sums all of them in a chain per row).
DENSE_MAX_EXPERTS = 64
# `grouped`'s rows per expert and round: the average plus this many of its binomial standard deviations.
GROUPED_CAPACITY_SIGMAS = 3
# Over expert leaves `pairs` runs while the step has at most this many (row, expert) pairs per expert:
# a loop step reads its expert in place, and the pairs run in expert order, so an expert's later
# pairs read it from cache; the pairs stay cheaper than `dense` (every expert on every row) and
# `grouped` (rounds of `grouped_capacity` rows) until the experts are this loaded.
LEAVES_PAIRS_PER_EXPERT = 8
# Expert stacks held one leaf per expert only up to this many experts: `pairs` then compiles a
# switch of E branches, `dense` and `grouped` E products each.
EXPERT_LEAVES_MAX_EXPERTS = 64


def swiglu(gate, up, down):
    """down(silu(gate) * up): gate, up [..., I] (the input's projections), down [Hd, I]."""
    return linear(jax.nn.silu(gate) * up, down)


def dense_mlp(p, x, cfg: ModelConfig):
    """The dense SwiGLU MLP; p = {gate_up [2I, Hd] (gate rows, then up), down [Hd, I]}."""
    gate, up = linear_parts(x, p["gate_up"], dense_in_rows(cfg))
    return swiglu(gate, up, p["down"])


def moe_form(rows: int, cfg: ModelConfig, expert_leaves: bool = False) -> MoeForm:
    """The form `moe` runs for a step of `rows` rows, over expert stacks held as arrays or, with
    `expert_leaves`, one leaf per expert (`ExpertLeaves`):
    - `dense` when every expert on every row is at most `DENSE_MAX_MACS` multiply-adds: every
      expert on every row, weighted by the row's routing weight (0 when not selected), reading
      each weight once (cost grows with E, not top_k);
    - `pairs` when rows x top_k <= E (the step cannot touch more experts than there are), or
      <= `LEAVES_PAIRS_PER_EXPERT` x E over expert leaves: one (row, slot) pair at a time, reading
      only the selected experts (cost and traffic grow with rows x top_k);
    - `grouped` when the experts get `GROUPED_MIN_PAIRS_PER_EXPERT` pairs each on average, or
      there are more than `DENSE_MAX_EXPERTS`: rows sorted by expert and run as matmuls batched
      over the experts, `grouped_capacity` rows per expert and round (cost grows with the
      most-loaded expert's rows);
    - `dense` otherwise.
    """
    e, pairs = cfg.num_experts, rows * cfg.num_experts_per_tok
    if rows * e * 3 * cfg.moe_intermediate_size * cfg.hidden_size <= DENSE_MAX_MACS:
        return "dense"
    if pairs <= e * (LEAVES_PAIRS_PER_EXPERT if expert_leaves else 1):
        return "pairs"
    if pairs >= GROUPED_MIN_PAIRS_PER_EXPERT * e or e > DENSE_MAX_EXPERTS:
        return "grouped"
    return "dense"


def grouped_capacity(rows: int, cfg: ModelConfig) -> int:
    """Rows per expert in one round of the `grouped` form: the average load m plus
    GROUPED_CAPACITY_SIGMAS x sqrt(m) (uniform routing loads an expert ~ binomially), in multiples
    of 8, so a balanced step takes one round."""
    mean = rows * cfg.num_experts_per_tok / cfg.num_experts
    return 8 * math.ceil((mean + GROUPED_CAPACITY_SIGMAS * math.sqrt(mean)) / 8)


def _act(gu, inter: int):
    return jax.nn.silu(gu[..., :inter]) * gu[..., inter:]


def _dense(x, top_i, top_w, gate_up, down, inter: int):
    """Every expert on every row. x [R, Hd]; top_i, top_w [R, k] -> [R, Hd].
    NOTE: gate_up against every expert at once and down batched over experts: an einsum over
    (expert, intermediate) at once makes XLA CPU copy `down` into another layout at every step."""
    e = gate_up.shape[0]
    combine = ordered_sum(jax.nn.one_hot(top_i, e, dtype=x.dtype) * top_w[..., None], axis=-2)  # [R, E]
    act = _act(linear_all_experts(x, gate_up), inter)  # [R, E, I]
    y = linear_per_expert(jnp.swapaxes(act, 0, 1), down)  # [E, R, Hd]
    return ordered_sum(y * combine.T[..., None], axis=0)


def _expert(gate_up, down, x, inter: int):
    """One expert's SwiGLU: x [..., Hd] with gate_up [2I, Hd], down [Hd, I] -> [..., Hd]."""
    return linear(_act(linear(x, gate_up), inter), down)


def _each_expert(xs, gate_up, down, inter: int):
    """Expert e's SwiGLU on its own rows xs[e]: xs [E, C, Hd] -> [E, C, Hd]; batched over the
    experts of a stack, expert by expert (one stack of the outputs) over `ExpertLeaves`."""
    if isinstance(gate_up, ExpertLeaves):
        return jnp.stack([_expert(g, d, xs[e], inter) for e, (g, d) in enumerate(zip(gate_up.experts, down.experts))])
    return linear_per_expert(_act(linear_per_expert(xs, gate_up), inter), down)


def _pairs_by_expert(top_i):
    """The (row, slot) pair ids r * k + s of top_i [R, k] sorted by expert, rows in order within an
    expert (a stable sort). -> [R * k] int32."""
    return jnp.argsort(top_i.reshape(-1), stable=True).astype(jnp.int32)


def _pairs(x, top_i, top_w, gate_up, down, inter: int):
    """One (row, slot) pair per loop step: each step runs the one expert it selects
    (`linear.with_expert`: its own leaves, or the expert copied out of the stacks; the scratch then
    holds one expert's weights). The pairs run in expert order, rows in order within an expert, so
    each row still adds its experts in expert order. x [R, Hd] -> [R, Hd].
    NOTE: expert order, not row order: an expert that several rows select is read from memory once
    and then from cache by the pairs that follow it (in row order, the other experts read between
    two rows' pairs evicted it)."""
    k = top_i.shape[-1]
    run = functools.partial(_expert, inter=inter)
    order = None if top_i.shape[0] == 1 else _pairs_by_expert(top_i)  # (one row's slots are in expert order)

    def pair(j, acc):
        p = j if order is None else order[j]
        r, s = p // k, p % k
        xr = jax.lax.dynamic_index_in_dim(x, r, keepdims=False)
        y = with_expert(top_i[r, s], run, (gate_up, down), xr)
        return acc.at[r].add(y * top_w[r, s])

    return jax.lax.fori_loop(0, top_i.size, pair, jnp.zeros_like(x))


def _grouped(x, top_i, top_w, gate_up, down, inter: int, capacity: int):
    """Rows grouped by expert. x [R, Hd] -> [R, Hd].

    The (row, slot) pairs are sorted by expert; round j runs rows j*C .. (j+1)*C - 1 of every
    expert's group (C = `capacity`) as one matmul batched over the experts, reading the whole
    weight leaves in place, and stores each output at its pair. The rounds continue while an
    expert has rows left (one round when the load is within C of every expert, E x C rows of
    work each), then each row sums its pairs in slot (= expert) order.
    NOTE: not `jax.lax.ragged_dot`: XLA CPU lowers it to one masked dense matmul over every
    expert (E times the work, and a transposed copy of the weights).
    """
    e_count, hd = gate_up.shape[0], x.shape[-1]
    n, k = top_i.shape
    experts = top_i.reshape(-1)
    order = _pairs_by_expert(top_i)
    counts = jnp.zeros(e_count, jnp.int32).at[experts].add(1)
    starts = jnp.cumsum(counts) - counts
    lane = jnp.arange(capacity, dtype=jnp.int32)

    def round_(carry):
        j, out = carry
        rank = j * capacity + lane  # [C]
        valid = rank[None, :] < counts[:, None]  # [E, C]
        pair = order[jnp.where(valid, starts[:, None] + rank[None, :], 0)]
        xs = jnp.where(valid[..., None], x[pair // k], 0)  # [E, C, Hd]
        y = _each_expert(xs, gate_up, down, inter)
        out = out.at[jnp.where(valid, pair, n * k).reshape(-1)].set(y.reshape(-1, hd), mode="drop")
        return j + 1, out

    # NOTE: the rounds write every pair exactly once, so the loop's output buffer starts as any
    # array computed here, not as zeros: XLA gives a loop state that starts as a constant an
    # allocation of its own, which no other layer's loop then reuses.
    init = jnp.broadcast_to(x[:, None, :], (n, k, hd)).reshape(n * k, hd)
    most = jnp.max(counts)
    _, out = jax.lax.while_loop(lambda c: c[0] * capacity < most, round_, (jnp.int32(0), init))
    return ordered_sum(out.reshape(n, k, hd) * top_w[..., None], axis=-2)


def _on_local_experts(run, n: int, x, top_i, top_w, gate_up, down):
    """`run(x, top_i, top_w, gate_up, down)` with the experts split over the n devices of
    `EXPERT_AXES`: each device runs its own experts (the pairs routed elsewhere get weight 0 and
    expert 0, so every form keeps its shapes) and the routed outputs are summed over the devices.
    NOTE: under `shard_map`, not the partitioner: a loop's dynamic index into an expert axis split
    over devices would make XLA gather every expert's weights onto each device."""
    local = gate_up.shape[0] // n

    def body(x, top_i, top_w, gate_up, down):
        rel = top_i - jax.lax.axis_index(EXPERT_AXES) * local
        mine = (rel >= 0) & (rel < local)
        y = run(x, jnp.where(mine, rel, 0), jnp.where(mine, top_w, jnp.zeros_like(top_w)), gate_up, down)
        return jax.lax.psum(y, EXPERT_AXES)

    experts = PartitionSpec(EXPERT_AXES)
    rows = PartitionSpec()
    return jax.shard_map(body, in_specs=(rows, rows, rows, experts, experts), out_specs=rows, check_vma=False)(
        x, top_i, top_w, gate_up, down
    )


def expert_leaves_apply(cfg: ModelConfig) -> bool:
    """Whether an engine holds cfg's expert stacks one leaf per expert where its layout allows
    (`backend_layout`): when a one-row step runs the `pairs` form (whose every loop step would
    otherwise copy its expert out of the stack) and there are at most `EXPERT_LEAVES_MAX_EXPERTS`."""
    return cfg.num_experts > 0 and cfg.num_experts <= EXPERT_LEAVES_MAX_EXPERTS and moe_form(1, cfg) == "pairs"


def _map_moe_blocks(tree, fn):
    """tree with every MoE block (`is_moe_block`) replaced by fn(block)."""
    if isinstance(tree, dict):
        return fn(tree) if is_moe_block(tree) else {k: _map_moe_blocks(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_moe_blocks(v, fn) for v in tree)
    return tree


def split_expert_stacks(params):
    """params with every MoE block's `gate_up` and `down` stacks as `ExpertLeaves`."""
    return _map_moe_blocks(
        params, lambda b: {**b, "gate_up": ExpertLeaves.of(b["gate_up"]), "down": ExpertLeaves.of(b["down"])}
    )


def join_expert_stacks(params):
    """`split_expert_stacks`' inverse (blocks already stacked are left as they are)."""

    def join(b):
        return {k: v.stack() if isinstance(v, ExpertLeaves) else v for k, v in b.items()}

    return _map_moe_blocks(params, join)


def top_k(probs, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k` of the router's probabilities [..., E] (values and int32 indices [..., k],
    largest first, the lower index first among equal values), as a stable sort.

    NOTE: XLA CPU lowers `lax.top_k` to a sort whose index operand is an iota of the whole
    [rows, E], and schedules every layer's iota at the program's start (an 8192-token prefill of
    the 80B held 48 of them, 16 MiB each). Here the indices pass through a select on the
    probabilities (never taken: they are >= 0 or NaN), so each is computed where its layer sorts."""
    axis = probs.ndim - 1
    idx = jnp.where(probs < 0, 0, jax.lax.broadcasted_iota(jnp.int32, probs.shape, axis))
    neg, idx = jax.lax.sort((-probs, idx), dimension=axis, num_keys=1, is_stable=True)
    return -neg[..., :k], idx[..., :k]


def moe(p, x, cfg: ModelConfig, form: MoeForm | None = None):
    """Sparse MoE block. x: [..., Hd]. p: router [E + 1, Hd] (the router, the shared-expert gate),
    gate_up [E, 2I, Hd] (gate rows first), down [E, Hd, I], shared_gate_up [2Is, Hd] (gate rows
    first), shared_down [Hd, Is]. The routed experts run in `form`, by default the one `moe_form`
    picks for the row count (the tests and `python -m benchmarks moe-forms` force each); the shared expert is
    a dense SwiGLU (split over the tensor axis like the dense MLP)."""
    # NOTE: the router is replicated (its rows and the one-row shared gate do not split over heads): groups=1.
    logits, shared_scale = linear_parts(x, p["router"], moe_router_rows(cfg), groups=1)
    logits32 = logits.astype(jnp.float32)
    e = jnp.exp(logits32 - fenced(jnp.max(logits32, axis=-1, keepdims=True), products_invariant()))
    probs = e / pairwise_sum(e)[..., None]  # softmax, with a shape-invariant sum
    top_w, top_i = top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        top_w = top_w / pairwise_sum(top_w)[..., None]
    hd = x.shape[-1]
    rows = x.size // hd
    form = form or moe_form(rows, cfg, isinstance(p["gate_up"], ExpertLeaves))
    top_i, top_w = top_i.reshape(rows, -1), top_w.astype(x.dtype).reshape(rows, -1)
    if form != "dense":  # the slots in expert order, the order `dense` sums the experts in
        top_i, top_w = jax.lax.sort((top_i, top_w), num_keys=1)
    inter = cfg.moe_intermediate_size

    def run(x, top_i, top_w, gate_up, down):
        if form == "pairs":
            return _pairs(x, top_i, top_w, gate_up, down, inter)
        if form == "grouped":
            return _grouped(x, top_i, top_w, gate_up, down, inter, grouped_capacity(rows, cfg))
        return _dense(x, top_i, top_w, gate_up, down, inter)

    args = (x.reshape(rows, hd), top_i, top_w, p["gate_up"], p["down"])
    n = mesh_devices(EXPERT_AXES)
    routed = run(*args) if n == 1 else _on_local_experts(run, n, *args)
    shared_gate, shared_up = linear_parts(x, p["shared_gate_up"], shared_in_rows(cfg))
    shared = swiglu(shared_gate, shared_up, p["shared_down"]) * jax.nn.sigmoid(shared_scale)
    return routed.reshape(x.shape) + shared


def is_moe_block(p) -> bool:
    """Whether a layer's feed-forward params are an MoE block (they carry a shared expert)."""
    return "shared_down" in p


def ffn(p, x, cfg: ModelConfig):
    """The layer's feed-forward: MoE when its params are an MoE block, else the dense MLP."""
    return moe(p, x, cfg) if is_moe_block(p) else dense_mlp(p, x, cfg)
