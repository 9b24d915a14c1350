"""The engine's device state: one pytree allocated by one function.

Owns: `EnginePool` (every device buffer the engine holds besides the weights) and
`allocate_pool`, so `jax.eval_shape(allocate_pool, ...)` gives the exact bytes the engine
allocates — the memory planner reads those, never a formula of its own.

Layout (L_lin GDN layers, L_full attention layers, L_mtp MTP layers; units from `PoolCounts`):
- trunk.gdn_h      [L_lin, slots, nv, dk, dv]   f32 (f16 under `--ssm-h-dtype f16-pool`)
- trunk.gdn_conv   [L_lin, slots, C, Kc]        activation dtype (the last Kc pre-conv columns)
- trunk.kv_k/kv_v  [L_full, kv_blocks, bs, KV, D]  KV dtype; the last block is the null block
- trunk.verify_h   [L_lin, h_step_rows, nv, dk, dv]  write-on-accept h rows, tiered per slot by
                   the K ladder (slot s owns rows h_step_offsets[s]..[s+1]); None without spec
- trunk.verify_conv [L_lin, verify_slots, conv_steps, C, Kc]  window after each verify row
- trunk.ckpt_h / ckpt_conv [L_lin, checkpoint_slots, ...]  pre-verify state (replay rollback),
                   written by each GDN layer of a verify as it reads the live state
- draft_k/draft_v  [L_mtp, draft_kv_blocks, 16, KV, D]  the MTP head's own paged KV
- stash            [slots, Hd]  per slot: the pre-norm hidden of the last processed trunk row,
                   the one the next propose pairs with the last sampled token
- snap_h / snap_conv [L_lin, snapshot_slots, ...]  prefix-cache recurrent-state snapshots (the
                   live h and conv of a slot after a block-aligned prefill position)
- snap_stash       [snapshot_slots, Hd]  with a drafter: the snapshot's stash row
- snap_draft_k/v   [L_mtp, snapshot_slots, 16, KV, D]  with a drafter: the snapshot's partial
                   drafter block (its full blocks are shared through the prefix cache)
- draft_probs      [slots, draft_prob_rows, V]  f32, only under `--speculative-sampling rejection`
                   with a drafter: per slot, the law q each pending draft was drawn from (written
                   by a sampled propose, read by the next sampled verify's rejection rule)
Slot `slots - 1` is the padding dummy nothing real ever uses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from metrale_jax.config import ModelConfig
from metrale_jax.engine.capacity import PoolCounts
from metrale_jax.engine.settings import EngineSettings
from metrale_jax.model.state_io import TrunkState

KV_DTYPES = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn, "f32": jnp.float32}
H_DTYPES = {"f32": jnp.float32, "f16-pool": jnp.float16}


class EnginePool(struct.PyTreeNode):
    """Every device buffer the engine holds besides the weights (layout in the module docstring):
    a frozen pytree that every transition takes donated and returns updated."""

    trunk: TrunkState
    draft_k: jax.Array | None
    draft_v: jax.Array | None
    stash: jax.Array | None
    snap_h: jax.Array | None = None
    snap_conv: jax.Array | None = None
    snap_stash: jax.Array | None = None
    snap_draft_k: jax.Array | None = None
    snap_draft_v: jax.Array | None = None
    draft_probs: jax.Array | None = None


# Human names of the pools, in report order (the memory planner's rows).
POOL_LABELS = {
    "trunk.gdn_h": "GDN recurrent state (live)",
    "trunk.gdn_conv": "GDN conv window (live)",
    "trunk.kv_k": "KV cache K (attention layers)",
    "trunk.kv_v": "KV cache V (attention layers)",
    "trunk.verify_h": "GDN verify h rows (write-on-accept)",
    "trunk.verify_conv": "GDN verify conv rows",
    "trunk.ckpt_h": "GDN pre-verify checkpoint h",
    "trunk.ckpt_conv": "GDN pre-verify checkpoint conv",
    "draft_k": "MTP drafter KV K",
    "draft_v": "MTP drafter KV V",
    "stash": "accepted-hidden stash",
    "snap_h": "prefix-cache snapshot h (Marconi slots)",
    "snap_conv": "prefix-cache snapshot conv",
    "snap_stash": "prefix-cache snapshot stash",
    "snap_draft_k": "prefix-cache snapshot drafter block K",
    "snap_draft_v": "prefix-cache snapshot drafter block V",
    "draft_probs": "drafter laws of pending drafts (rejection sampling)",
}


def allocate_pool(cfg: ModelConfig, counts: PoolCounts, settings: EngineSettings, *, dtype=jnp.float32) -> EnginePool:
    """Zero-filled device state for `counts` (from `capacity.pool_counts(settings, cfg)`).

    dtype: the activation dtype (conv windows, stash). KV and h storage dtypes come from the
    settings. Pure: call it under `jax.eval_shape` for sizes without allocating.
    """
    nl, nf, nm = cfg.num_linear_layers, cfg.num_full_layers, cfg.num_mtp_layers
    h_unit = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    conv_unit = (cfg.conv_dim, cfg.linear_conv_kernel_dim)
    kv_unit = (cfg.num_key_value_heads, cfg.head_dim)
    hdt = H_DTYPES[settings.ssm_h_dtype]
    kvdt = KV_DTYPES[settings.kv_cache_dtype]
    zeros = jnp.zeros
    spec = counts.speculative
    ck = counts.checkpoint_slots
    trunk = TrunkState(
        gdn_h=zeros((nl, counts.slots, *h_unit), hdt),
        gdn_conv=zeros((nl, counts.slots, *conv_unit), dtype),
        kv_k=zeros((nf, counts.kv_blocks, counts.block_size, *kv_unit), kvdt),
        kv_v=zeros((nf, counts.kv_blocks, counts.block_size, *kv_unit), kvdt),
        verify_h=zeros((nl, counts.h_step_rows, *h_unit), hdt) if spec and counts.h_step_rows else None,
        verify_conv=zeros((nl, counts.verify_slots, counts.conv_steps, *conv_unit), dtype)
        if spec and counts.conv_steps
        else None,
        ckpt_h=zeros((nl, ck, *h_unit), hdt) if ck else None,
        ckpt_conv=zeros((nl, ck, *conv_unit), dtype) if ck else None,
    )
    drafter = counts.drafter
    sn = counts.snapshot_slots
    dsn = sn if drafter else 0
    draft_unit = (counts.draft_block_size, *kv_unit)
    return EnginePool(
        trunk=trunk,
        draft_k=zeros((nm, counts.draft_kv_blocks, counts.draft_block_size, *kv_unit), kvdt) if drafter else None,
        draft_v=zeros((nm, counts.draft_kv_blocks, counts.draft_block_size, *kv_unit), kvdt) if drafter else None,
        stash=zeros((counts.stash_rows, cfg.hidden_size), dtype) if drafter else None,
        snap_h=zeros((nl, sn, *h_unit), hdt) if sn else None,
        snap_conv=zeros((nl, sn, *conv_unit), dtype) if sn else None,
        snap_stash=zeros((dsn, cfg.hidden_size), dtype) if dsn else None,
        snap_draft_k=zeros((nm, dsn, *draft_unit), kvdt) if dsn else None,
        snap_draft_v=zeros((nm, dsn, *draft_unit), kvdt) if dsn else None,
        draft_probs=zeros((counts.slots, counts.draft_prob_rows, cfg.vocab_size), jnp.float32)
        if counts.draft_prob_rows
        else None,
    )


def pool_buffers(pool) -> list[tuple[str, tuple[int, ...], str, int]]:
    """(name, shape, dtype, nbytes) of every buffer of an `EnginePool` or its `eval_shape`."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(pool)[0]:
        name = ".".join(str(getattr(k, "name", k)) for k in path)
        out.append((name, tuple(leaf.shape), str(leaf.dtype), int(leaf.size) * leaf.dtype.itemsize))
    return out
