"""Block managers for the host-only tests (`test_blocks`, `test_prefix_cache_machine`).

Owns: `speculative_manager`, a speculative serve's `BlockManager` (trunk and MTP drafter blocks)
built from serve settings as the engine builds it. Imports neither JAX nor NumPy, so the modules
that use it can run in an interpreter without them."""

from __future__ import annotations

import types

from metrale_jax.engine.blocks import BlockManager
from metrale_jax.engine.capacity import DEFAULT_K_LADDER, UNSET_PREFILL_TOKENS, pool_counts
from metrale_jax.engine.settings import EngineSettings


def speculative_manager(
    slots: int, max_seq_len: int, block: int, prefix_caching: bool, drafts: int = 3
) -> BlockManager:
    """A `BlockManager` of `slots` slots with `drafts` MTP drafts (drafter blocks too), f32 caches,
    snapshot rollback and two SSM cache slots, for one linear and one MTP layer."""
    s = EngineSettings(
        max_batch_size=slots,
        max_seq_len=max_seq_len,
        block_size=block,
        speculative=True,
        num_drafts=drafts,
        mtp_max_seqs=slots,
        k_ladder=DEFAULT_K_LADDER,
        kv_cache_dtype="f32",
        ssm_h_dtype="f32",
        ssm_rollback_mode="snapshot",
        max_prefill_tokens=UNSET_PREFILL_TOKENS,
        enable_prefix_caching=prefix_caching,
        ssm_cache_slots=2,
        ssm_decode_ring_slots=0,
        gpu_memory_utilization=0.9,
    )
    counts = pool_counts(s, types.SimpleNamespace(num_linear_layers=1, num_mtp_layers=1))
    assert counts.drafter
    return BlockManager(counts, max_seq_len, prefix_caching)
