"""Tensor and expert parallelism: the device mesh and the layout of every parameter and pool leaf.

Owns: `MeshError` and `check_mesh` (the mesh flags against a config and the devices present),
`make_mesh`, the layout table (`PARAM_LAYOUT`, `POOL_LAYOUT`: each leaf's `PartitionSpec` over its
trailing axes, stated once), `param_shardings` / `shard_params` / `unshard_params` (weights onto
the mesh, group-major, and back), `pool_shardings` / `allocate_sharded_pool` / `abstract_pool`
(the pool on the mesh, or its sharded shapes for the planner), `canonical_pool` / `place_pool`
(the pool in checkpoint channel order, and back), `device_bytes` (one device's share of a leaf),
and for the planner `planning_mesh` (the abstract mesh a serve's settings name) and
`param_divisors` (how many ways each parameter leaf is split).

The mesh has two axes, `ep` (experts) x `tp` (heads). Layout (XLA SPMD propagates the rest; a
contraction over a sharded axis becomes an all-reduce):
- attention: q (with its gate) / k / v rows by heads, `wo` by columns (its input rows, reduced);
  KV cache and the drafter's KV by KV heads;
- GDN: by key-head groups: group g holds key heads g*nk/N.., their value heads (nv/nk per key
  head, contiguous) and those heads' q, k, v conv channels, z, b, a rows, dt_bias and A_log;
  `out` by columns; the live h, verify h rows, checkpoints and prefix-cache snapshots by value
  heads, conv windows by channel (group-major);
- dense MLP and the MoE's shared expert: gate/up rows, `down` by columns; MoE experts over every
  device (`ep` x `tp`, each device runs its own: `model.mlp`); the MoE's router (with the one-row
  shared-expert gate) replicated;
- lm_head (untied) by vocabulary rows: each device computes its slice of the logits and the
  argmax / softmax over the vocabulary reduce across devices; the embedding (which a tied
  lm_head shares), norms, the MTP fc and the stash replicated.

Invariants:
- A row-stacked leaf sharded over `tp` is stored group-major (`model.linear.split_groups`): the
  tp groups in order, each holding its 1/tp of every part, so a device's rows are its heads of
  every part and the split after the one product stays on the device. The GDN conv channels
  (weight, windows) are group-major the same way. With tp = 1 every order is the checkpoint's.
- Every pool leaf keeps its sharding across transitions (`programs.compile_transition`
  constrains the returned pool to the donated one's), so a step neither reshards nor copies it.
- Host bookkeeping (slots, blocks, lengths) is global: no index is per device.
- An FP8 leaf (`Fp8BlockWeight`) shards as its weight does: values, block scales and kept rows
  (`tail`) each by the leaf's spec, the values and kept rows group-major over their own parts
  and the scales over the same parts in blocks, so a device holds whole blocks with their scales.
  Where a shard boundary would cut a block (a part's rows per device, or the columns per device,
  not a multiple of the block) `fp8_block_cut` names the tensor and `shard_params` refuses.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from metrale_jax.checkpoint import bindings
from metrale_jax.config import ModelConfig
from metrale_jax.engine.capacity import PoolCounts
from metrale_jax.engine.pool import EnginePool, allocate_pool, pool_buffers
from metrale_jax.engine.settings import EngineSettings
from metrale_jax.errors import MetraleError
from metrale_jax.model.fp8_linear import Fp8BlockWeight
from metrale_jax.model.linear import EXPERT_AXES, EXPERT_AXIS, TENSOR_AXIS
from metrale_jax.params import attn_in_rows, dense_in_rows, param_specs, shared_in_rows

TP, EP = TENSOR_AXIS, EXPERT_AXIS


class MeshError(MetraleError, ValueError):
    """Mesh flags the model or the machine cannot take (one line)."""


def _gdn_parts(cfg: ModelConfig) -> tuple[int, ...]:
    """The GDN `w_in` rows as the parts that split by key-head groups: q, k, v (conv channels), z, b, a."""
    nv = cfg.linear_num_value_heads
    return (cfg.key_dim, cfg.key_dim, cfg.value_dim, cfg.value_dim, nv, nv)


def _conv_parts(cfg: ModelConfig) -> tuple[int, ...]:
    return (cfg.key_dim, cfg.key_dim, cfg.value_dim)


# The layout table: (mixer or block, leaf) -> (PartitionSpec of the leaf's trailing axes, the
# row parts of a group-major leaf or None). Leaves not named are replicated. "moe" is an MLP with
# a shared expert. A leading layer-group axis (scan layout) or layer axis (pool) is never sharded.
Axes = tuple[str | tuple[str, ...] | None, ...]
PARAM_LAYOUT: dict[tuple[str, str], tuple[Axes, Callable[[ModelConfig], tuple[int, ...]] | None]] = {
    ("", "lm_head"): ((TP, None), None),
    ("gdn", "w_in"): ((TP, None), _gdn_parts),
    ("gdn", "conv"): ((TP, None), _conv_parts),
    ("gdn", "dt_bias"): ((TP,), None),
    ("gdn", "A_log"): ((TP,), None),
    ("gdn", "out"): ((None, TP), None),
    ("attn", "w_in"): ((TP, None), attn_in_rows),
    ("attn", "wo"): ((None, TP), None),
    ("mlp", "gate_up"): ((TP, None), dense_in_rows),
    ("mlp", "down"): ((None, TP), None),
    ("moe", "gate_up"): ((EXPERT_AXES, None, None), None),
    ("moe", "down"): ((EXPERT_AXES, None, None), None),
    ("moe", "shared_gate_up"): ((TP, None), shared_in_rows),
    ("moe", "shared_down"): ((None, TP), None),
}

# Pool leaf -> (PartitionSpec of its trailing axes, whether that axis holds group-major GDN conv channels).
POOL_LAYOUT: dict[str, tuple[tuple[str | None, ...], bool]] = {
    "trunk.gdn_h": ((TP, None, None), False),  # [.., nv, dk, dv]
    "trunk.gdn_conv": ((TP, None), True),  # [.., C, Kc]
    "trunk.kv_k": ((TP, None), False),  # [.., KV, D]
    "trunk.kv_v": ((TP, None), False),
    "trunk.verify_h": ((TP, None, None), False),
    "trunk.verify_conv": ((TP, None), True),
    "trunk.ckpt_h": ((TP, None, None), False),
    "trunk.ckpt_conv": ((TP, None), True),
    "draft_k": ((TP, None), False),
    "draft_v": ((TP, None), False),
    "stash": ((), False),
    "snap_h": ((TP, None, None), False),  # prefix-cache snapshots: as the live state they copy
    "snap_conv": ((TP, None), True),
    "snap_stash": ((), False),
    "snap_draft_k": ((TP, None), False),
    "snap_draft_v": ((TP, None), False),
    "draft_probs": ((), False),  # [slots, rows, V]: replicated (each device's verify reads its sequences' rows)
}


def check_mesh(cfg: ModelConfig, tp: int, ep: int, devices: int) -> None:
    """Raise MeshError (one line) unless tp >= 1, ep >= 1, tp divides the attention KV heads, the GDN
    key heads, the attention heads, the GDN value heads, the dense MLP and shared-expert widths and
    (an untied lm_head) the vocabulary, tp * ep divides the experts (ep = 1 without experts), and tp * ep <= devices."""
    if tp < 1 or ep < 1:
        raise MeshError(f"--tensor-parallel-size {tp} and --expert-parallel-size {ep} must be >= 1")
    heads = {
        "attention KV heads": cfg.num_key_value_heads,
        "GDN key heads": cfg.linear_num_key_heads,
        "attention heads": cfg.num_attention_heads,
        "GDN value heads": cfg.linear_num_value_heads,
    }
    if not all(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        heads["dense MLP intermediate size"] = cfg.intermediate_size
    if any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        heads["shared-expert intermediate size"] = cfg.shared_expert_intermediate_size
    if not cfg.tie_word_embeddings:
        heads["vocabulary entries"] = cfg.vocab_size
    for what, n in heads.items():
        if n and n % tp:
            raise MeshError(f"--tensor-parallel-size {tp} does not divide the model's {n} {what}")
    experts = cfg.num_experts if any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) else 0
    if ep > 1 and not experts:
        raise MeshError(f"--expert-parallel-size {ep} needs a model with experts")
    if experts and experts % (tp * ep):
        raise MeshError(f"the mesh's {tp} x {ep} devices do not divide the model's {experts} experts")
    if tp * ep > devices:
        raise MeshError(f"a mesh of {tp} x {ep} = {tp * ep} devices needs more than the {devices} present")


def make_mesh(cfg: ModelConfig, tp: int, ep: int, devices: list | None = None) -> Mesh | None:
    """The (ep, tp) mesh over the first tp * ep of `devices` (default `jax.devices()`), after
    `check_mesh`; None for 1 x 1 (the single-device engine)."""
    devices = jax.devices() if devices is None else devices
    check_mesh(cfg, tp, ep, len(devices))
    if tp * ep == 1:
        return None
    grid = np.array(devices[: tp * ep], dtype=object).reshape(ep, tp)
    return Mesh(grid, (EP, TP), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def mesh_sizes(mesh: Mesh | None) -> tuple[int, int]:
    """(tp, ep) of a mesh; (1, 1) for None."""
    shape = dict(mesh.shape) if mesh is not None else {}
    return int(shape.get(TP, 1)), int(shape.get(EP, 1))


def planning_mesh(settings: EngineSettings) -> AbstractMesh | None:
    """The abstract (ep, tp) mesh of `settings`' --tensor/--expert-parallel-size (no devices
    needed: shardings and shard shapes only); None for 1 x 1."""
    tp, ep = settings.tensor_parallel_size, settings.expert_parallel_size
    return None if tp * ep == 1 else AbstractMesh((ep, tp), (EP, TP))


def param_divisors(cfg: ModelConfig, tp: int, ep: int) -> dict[tuple, int]:
    """{parameter path (as `checkpoint.bindings` names it): the number of devices its leaf is split
    over} under a tp x ep mesh (1: replicated); each device holds 1/divisor of the leaf."""
    sizes = {TP: tp, EP: ep, None: 1, EXPERT_AXES: tp * ep}
    tree = _param_layout(param_specs(cfg), cfg, lambda x, trailing, _: math.prod(sizes[a] for a in trailing))
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path): n for path, n in leaves}


def _spec(trailing: tuple[str | None, ...], ndim: int) -> PartitionSpec:
    return PartitionSpec(*([None] * (ndim - len(trailing))), *trailing)


def _group_major_index(parts: tuple[int, ...], groups: int) -> np.ndarray:
    """Row order of a group-major leaf: for each group g, rows g/groups.. of every part in turn."""
    starts = np.cumsum((0, *parts))[:-1]
    return np.concatenate(
        [
            np.arange(s + g * (n // groups), s + (g + 1) * (n // groups))
            for g in range(groups)
            for s, n in zip(starts, parts)
        ]
    )


def _param_layout(params: dict, cfg: ModelConfig, fn: Callable, with_path: bool = False) -> dict:
    """params with each leaf (an `Fp8BlockWeight` is one) replaced by fn(leaf, trailing spec, parts
    or None), or fn(leaf, trailing, parts, path) with `with_path` (path: the leaf's keys)."""

    def walk(node, block: str, path: tuple):
        if isinstance(node, list):
            return [walk(x, block, (*path, i)) for i, x in enumerate(node)]
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                if isinstance(v, dict | list):
                    moe = k == "mlp" and isinstance(v, dict) and "shared_down" in v
                    out[k] = walk(v, "moe" if moe else k, (*path, k))
                else:
                    trailing, parts = PARAM_LAYOUT.get((block, k), ((), None))
                    args = (v, trailing, parts(cfg) if parts else None)
                    out[k] = fn(*args, (*path, k)) if with_path else fn(*args)
            return out
        return node

    return walk(params, "", ())


def _fp8_parts(x: Fp8BlockWeight, parts: tuple[int, ...] | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The row parts of an FP8 leaf's values and of its kept rows (`tail`): the leaf's parts (one
    part of all its rows when not group-major) split where the values end."""
    rows = x.q.shape[-2]
    tail = 0 if x.tail is None else x.tail.shape[-2]
    parts = parts or (rows + tail,)
    ends = np.cumsum(parts)
    cut = int(np.searchsorted(ends, rows, side="right"))
    if rows and (cut == 0 or ends[cut - 1] != rows):
        raise MeshError(f"an FP8 leaf of {rows} converted rows does not end at a part of {list(parts)}")
    return tuple(parts[:cut]), tuple(parts[cut:])


def fp8_block_cut(
    x: Fp8BlockWeight, trailing: tuple, parts: tuple[int, ...] | None, tp: int
) -> tuple[int | None, str] | None:
    """Where and why sharding FP8 leaf `x` by `trailing` over `tp` tensor groups would cut one of
    its scale blocks: (the cut part's first row, or None for the columns; the reason), None when
    every device holds whole blocks. Each converted part's rows per device must be a multiple of
    the block's rows (row-sharded leaves), the columns per device of its columns (column-sharded);
    an expert axis splits whole experts."""
    if tp == 1 or TP not in trailing:
        return None
    rb, cb = x.block
    if len(trailing) - 1 - trailing.index(TP) == 1:  # the rows
        start = 0
        for n in _fp8_parts(x, parts)[0]:
            if n % (tp * rb):
                return (
                    start,
                    f"a part of {n} rows split {tp} ways is {n / tp:g} rows a device, not whole {rb}-row blocks",
                )
            start += n
        return None
    cols = x.q.shape[-1]
    if cols % (tp * cb):
        return None, f"its {cols} columns split {tp} ways are {cols / tp:g} a device, not whole {cb}-column blocks"
    return None


def _fp8_tensor_name(cfg: ModelConfig, path: tuple, row: int | None) -> str:
    """The checkpoint tensor holding row `row` (None: the first tensor) of the leaf at `path`
    (found by assembling the binding from its tensors' indices); the path when no binding has it."""
    b = next((b for b in bindings(cfg) if tuple(b.path) == tuple(path)), None)
    if b is None:
        return ".".join(map(str, path))
    if row is None:
        return b.names[0]
    marks = b.assemble([np.full((*shape[:-1], 1), i) for i, shape in enumerate(b.shapes)])
    return b.names[int(np.asarray(marks).reshape(-1, marks.shape[-2])[0, row])]


def check_fp8_blocks(params: dict, cfg: ModelConfig, tp: int) -> None:
    """Raise MeshError (one line, naming the checkpoint tensor) where a `tp`-way shard boundary
    would cut an FP8 leaf's scale block (`fp8_block_cut`); a no-op without FP8 leaves."""

    def check(x, trailing, parts, path):
        cut = fp8_block_cut(x, trailing, parts, tp) if isinstance(x, Fp8BlockWeight) else None
        if cut:
            raise MeshError(
                f"FP8 tensor {_fp8_tensor_name(cfg, path, cut[0])}: --tensor-parallel-size {tp} cuts its "
                f"{x.block[0]}x{x.block[1]} scale blocks ({cut[1]})"
            )
        return x

    _param_layout(params, cfg, check, with_path=True)


def _fp8_arrays(x: Fp8BlockWeight, trailing: tuple, parts: tuple[int, ...] | None, fn: Callable):
    """`x` with fn(array, trailing, array parts or None) applied to its values, block scales and kept
    rows; a group-major leaf's values and tail take their own parts, the scales the values' in blocks."""
    q_parts, tail_parts = _fp8_parts(x, parts) if parts else ((), ())
    scale_parts = tuple(n // x.block[0] for n in q_parts) if parts else None
    return Fp8BlockWeight(
        fn(x.q, trailing, q_parts or None),
        fn(x.scale, trailing, scale_parts),
        None if x.tail is None else fn(x.tail, trailing, tail_parts or None),
        x.block,
    )


def param_shardings(params: dict, cfg: ModelConfig, mesh: Mesh | AbstractMesh) -> dict:
    """The NamedSharding of every leaf of `params` (list or scan layout, arrays or shape structs; an
    FP8 leaf's values, scales and kept rows each by the leaf's spec)."""

    def sharding(x, trailing, parts):
        if isinstance(x, Fp8BlockWeight):
            return _fp8_arrays(x, trailing, parts, lambda a, t, _: sharding(a, t, None))
        return NamedSharding(mesh, _spec(trailing, x.ndim))

    return _param_layout(params, cfg, sharding)


def _regroup(x, axis: int, parts: tuple[int, ...], tp: int, inverse: bool):
    """x with its `axis` (checkpoint order, `parts`) put group-major for tp groups, or back (`inverse`)."""
    if tp == 1:
        return x
    index = _group_major_index(parts, tp)
    return (np if isinstance(x, np.ndarray) else jnp).take(x, np.argsort(index) if inverse else index, axis=axis)


def _param_axis(x, trailing: tuple[str | None, ...]) -> int:
    return x.ndim - len(trailing) + trailing.index(TP)


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """`params` (checkpoint order) on the mesh: group-major leaves reordered for the mesh's tp
    groups (along the axis the table shards), then each leaf placed with its sharding. Raises
    MeshError where a shard boundary cuts an FP8 scale block (`check_fp8_blocks`)."""
    tp, _ = mesh_sizes(mesh)
    check_fp8_blocks(params, cfg, tp)

    def place(x, trailing, parts):
        if isinstance(x, Fp8BlockWeight):
            return _fp8_arrays(x, trailing, parts, place)
        x = x if parts is None else _regroup(x, _param_axis(x, trailing), parts, tp, inverse=False)
        return jax.device_put(x, NamedSharding(mesh, _spec(trailing, x.ndim)))

    return _param_layout(params, cfg, place)


def unshard_params(params: dict, cfg: ModelConfig, mesh: Mesh | None) -> dict:
    """`shard_params`'s inverse: every leaf in checkpoint order on the default device."""
    tp, _ = mesh_sizes(mesh)

    def back(x, trailing, parts):
        if isinstance(x, Fp8BlockWeight):
            return _fp8_arrays(x, trailing, parts, back)
        x = jax.device_put(x, jax.devices()[0])
        return x if parts is None else _regroup(x, _param_axis(x, trailing), parts, tp, inverse=True)

    return _param_layout(params, cfg, back)


def pool_shardings(pool, mesh: Mesh | AbstractMesh) -> EnginePool:
    """The NamedSharding of every leaf of an `EnginePool` (or its `eval_shape`)."""
    names = [name for name, *_ in pool_buffers(pool)]
    leaves, tree = jax.tree_util.tree_flatten(pool)
    return jax.tree_util.tree_unflatten(
        tree, [NamedSharding(mesh, _spec(POOL_LAYOUT[n][0], x.ndim)) for n, x in zip(names, leaves)]
    )


def abstract_pool(
    cfg: ModelConfig, counts: PoolCounts, settings: EngineSettings, *, dtype, mesh: Mesh | AbstractMesh | None
) -> EnginePool:
    """`jax.eval_shape(allocate_pool, ...)`, each struct carrying its sharding under `mesh` (concrete
    or abstract)."""
    shapes = jax.eval_shape(lambda: allocate_pool(cfg, counts, settings, dtype=dtype))
    if mesh is None:
        return shapes
    return jax.tree_util.tree_map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, pool_shardings(shapes, mesh)
    )


def allocate_sharded_pool(
    cfg: ModelConfig, counts: PoolCounts, settings: EngineSettings, *, dtype, mesh: Mesh | None
) -> EnginePool:
    """`allocate_pool` with every leaf created in place on the mesh (each device zero-fills its shard)."""
    if mesh is None:
        return allocate_pool(cfg, counts, settings, dtype=dtype)
    shardings = pool_shardings(abstract_pool(cfg, counts, settings, dtype=dtype, mesh=None), mesh)
    return jax.jit(lambda: allocate_pool(cfg, counts, settings, dtype=dtype), out_shardings=shardings)()


def _pool_channels(pool, cfg: ModelConfig, tp: int, inverse: bool):
    """Host copies of every pool leaf, the conv channel axes put group-major for tp (or back)."""
    names = [name for name, *_ in pool_buffers(pool)]
    leaves, tree = jax.tree_util.tree_flatten(pool)
    out = []
    for name, x in zip(names, leaves):
        x = np.asarray(jax.device_get(x))
        trailing, channels = POOL_LAYOUT[name]
        out.append(_regroup(x, x.ndim - len(trailing), _conv_parts(cfg), tp, inverse) if channels else x)
    return jax.tree_util.tree_unflatten(tree, out)


def canonical_pool(pool: EnginePool, cfg: ModelConfig, mesh: Mesh | None) -> EnginePool:
    """`pool` on the host with its conv channel axes in checkpoint order (q, k, v): what a
    single-device engine holds in the same state (for comparing engines)."""
    return _pool_channels(pool, cfg, mesh_sizes(mesh)[0], inverse=True)


def place_pool(pool: EnginePool, cfg: ModelConfig, mesh: Mesh | None) -> EnginePool:
    """`canonical_pool`'s inverse: a checkpoint-order pool placed on `mesh` (None: the default device)."""
    grouped = _pool_channels(pool, cfg, mesh_sizes(mesh)[0], inverse=False)
    if mesh is None:
        return jax.tree_util.tree_map(jnp.asarray, grouped)
    return jax.device_put(grouped, pool_shardings(grouped, mesh))


def device_bytes(x) -> int:
    """Bytes one device holds of an array or sharded shape struct (the whole leaf when unsharded)."""
    sharding = getattr(x, "sharding", None)
    shape = sharding.shard_shape(tuple(x.shape)) if sharding is not None else tuple(x.shape)
    return math.prod(shape) * jnp.dtype(x.dtype).itemsize
