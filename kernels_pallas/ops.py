"""`PallasOps`: the `pallas` forward's implementations of the four stateful ops the trunk calls
(`metrale_jax.model.state_io.ReferenceOps` is the `xla` twin with the same methods).

Owns: the fallback policy. Each method asks its op's `*_supported` check first; a refusal runs the
reference instead, and the reason is recorded (and warned about once) so the engine can disclose
which ops did not run as kernels. Nothing else falls back: a kernel that accepts its arguments and
then fails raises.

Invariants:
- Refusals depend only on shapes, dtypes and the backend, and are decided while a forward is
  traced; `refusals()` therefore lists every refusal of every forward traced in this process.
- `write_kv` is the reference scatter by design (see `kernels_pallas.paged_attention.api`), not a
  refusal, and is not recorded.
- The dataclass is frozen and hashable: it is a static argument of jitted forwards.
"""

from __future__ import annotations

import dataclasses
import warnings

from kernels_pallas import common
from kernels_pallas.gdn import api as gdn_api
from kernels_pallas.paged_attention import api as attn_api

_REFUSALS: dict[tuple[str, str], None] = {}  # (op, reason), insertion-ordered


def _refused(op: str, reason: str | None) -> bool:
    """Record (and warn about, the first time) a refusal; True when `reason` is one."""
    if reason is None:
        return False
    if (op, reason) not in _REFUSALS:
        _REFUSALS[(op, reason)] = None
        warnings.warn(f"pallas forward: {op} runs the reference: {reason}", stacklevel=3)
    return True


@dataclasses.dataclass(frozen=True)
class PallasOps:
    """The kernels' forward. interpret: run the Pallas interpreter (the default off GPU)."""

    name: str = "pallas"
    interpret: bool = dataclasses.field(default_factory=common.default_interpret)

    @property
    def backend(self) -> str:
        return common.backend_of(self.interpret)

    @staticmethod
    def refusals() -> tuple[str, ...]:
        """Every recorded refusal, one "op: reason" line each, oldest first."""
        return tuple(f"{op}: {reason}" for op, reason in _REFUSALS)

    def gdn_chunk(self, q, k, v, g, beta, h0):
        """(o [B, T, H, dv] f32, final_state [B, H, dk, dv] f32); see `gdn.api.chunk_gated_delta_rule`."""
        args = (q, k, v, g, beta, h0)
        if _refused("gdn_chunk", gdn_api.gdn_chunk_supported(*args, backend=self.backend)):
            return gdn_api.chunk_gated_delta_rule(*args, implementation="reference")
        return gdn_api.chunk_gated_delta_rule(*args, interpret=self.interpret)

    def gdn_rows(self, q, k, v, g, beta, h0):
        """(o [B, T, H, dv] f32, states [B, T, H, dk, dv] f32); see `gdn.api.recurrent_gated_delta_rule`."""
        args = (q, k, v, g, beta, h0)
        if _refused("gdn_rows", gdn_api.gdn_rows_supported(*args, backend=self.backend)):
            return gdn_api.recurrent_gated_delta_rule(*args, implementation="reference")
        return gdn_api.recurrent_gated_delta_rule(*args, interpret=self.interpret)

    def write_kv(self, k_cache, v_cache, k, v, block_tables, positions, null_block, layer=None):
        """The new (k_cache, v_cache); the reference scatter on every backend."""
        return attn_api.write_kv(k_cache, v_cache, k, v, block_tables, positions, null_block, layer)

    def attention(self, q, k_cache, v_cache, block_tables, positions, scale, layer=None):
        """[B, T, H, D] in q's dtype; see `paged_attention.api.paged_attention`. With `layer`, the
        caches are stacked [L, NB, ...] and the kernel gets that layer's slice.
        NOTE: the kernel addresses one layer's cache (its offsets are int32), so the slice is taken
        here; XLA may materialise it (a per-step copy of the layer's KV the reference avoids)."""
        if layer is not None:
            k_cache, v_cache = k_cache[layer], v_cache[layer]
        args = (q, k_cache, v_cache, block_tables, positions)
        if _refused("attention", attn_api.paged_attention_supported(*args, backend=self.backend)):
            return attn_api.paged_attention(*args, scale, implementation="reference")
        return attn_api.paged_attention(*args, scale, interpret=self.interpret)
