"""The ops objects: the four stateful ops the trunk calls, as one protocol (`Ops`) and its two
implementations, `ReferenceOps` (the `xla` forward: the kernels' jnp reference twins) and
`PallasOps` (the `pallas` forward: the Pallas kernels, with the reference as fallback); and their
batch-invariant variants `InvariantOps` and `PallasInvariantOps` (`--batch-invariant`).

Owns: the ops contract (`Ops`), the names of the forwards (`Forward`), and the `pallas` forward's
fallback policy. Each `PallasOps` method asks its op's `*_supported` check first; a refusal runs the
reference instead, and the reason is recorded (and warned about once) so the engine can disclose
which ops did not run as kernels. Nothing else falls back: a kernel that accepts its arguments and
then fails raises.

Invariants:
- Both implementations have the same methods with the same parameters, and return the same shapes
  and dtypes; under the Pallas interpreter their GDN and attention results are byte-equal.
- Refusals depend only on shapes, dtypes and the backend, and are decided while a forward is
  traced; `PallasOps.refusals()` therefore lists every refusal of every forward traced in this process.
- `write_kv` is the reference scatter in both (see `kernels_pallas.paged_attention.api`), not a
  refusal, and is not recorded.
- The ops objects are frozen, hashable dataclasses: they are static arguments of jitted forwards,
  and `name` is what program caches and disclosures key on.
- Under a mesh with a tensor axis (`metrale_jax.model.linear.TENSOR_AXIS`), `PallasOps` runs each
  kernel in a `shard_map` over the heads (the GDN's key / value heads, the attention's query and KV
  heads, as the engine shards them): every device runs the kernel on its own heads, whose values are
  the single-device kernel's (no op mixes heads). The partitioner cannot split a kernel's custom call.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Literal, Protocol

import jax
from jax.sharding import PartitionSpec as P

from kernels_pallas import common
from kernels_pallas.gdn import api as gdn_api
from kernels_pallas.gdn import reference as gdn_ref
from kernels_pallas.paged_attention import api as attn_api
from kernels_pallas.paged_attention import reference as attn_ref

Forward = Literal["xla", "pallas"]  # the forwards: ReferenceOps' name and PallasOps'


class Ops(Protocol):
    """The stateful ops of the trunk (B sequences, T rows each; Hk key heads, H value heads, dk, dv
    the GDN key / value dims; KV kv heads, D head dim, NB blocks of bs rows in the KV pool).

    GDN (the delta rule, `kernels_pallas.gdn.reference`): q, k [B, T, Hk, dk] f32 (L2-normalised, q
    scaled by dk**-0.5); v [B, T, H, dv] f32; g [B, T, H] f32 log-decay (<= 0); beta [B, T, H] f32;
    h0 [B, H, dk, dv] f32 initial state. A row with k = beta = g = 0 leaves the state unchanged.

    Attention (`kernels_pallas.paged_attention.reference`): k_cache, v_cache [NB, bs, KV, D], or
    with `layer` (int32 scalar, may be traced) the stacked [L, NB, bs, KV, D] used at that layer;
    block_tables [B, MB] int32; positions [B, T] int32 (< 0 = padding row).
    """

    @property
    def name(self) -> str:
        """The forward's name (a `Forward`, or a variant's own name); program caches key on it."""
        ...

    def gdn_chunk(self, q, k, v, g, beta, h0) -> tuple[jax.Array, jax.Array]:
        """Chunked prefill: (o [B, T, H, dv] f32, final_state [B, H, dk, dv] f32)."""
        ...

    def gdn_rows(self, q, k, v, g, beta, h0) -> tuple[jax.Array, jax.Array]:
        """Row-by-row recurrence: (o [B, T, H, dv] f32, states [B, T, H, dk, dv] f32), states[:, t]
        the state after row t."""
        ...

    def write_kv(
        self, k_cache, v_cache, k, v, block_tables, positions, null_block: int, layer=None
    ) -> tuple[jax.Array, jax.Array]:
        """The new (k_cache, v_cache) with rows k, v [B, T, KV, D] written at their positions (cast to
        the cache dtype); padding rows write `null_block`. The caches are donated by the programs."""
        ...

    def attention(self, q, k_cache, v_cache, block_tables, positions, scale: float, layer=None) -> jax.Array:
        """Causal GQA attention of q [B, T, H, D] over keys 0..position of the own sequence:
        [B, T, H, D] in q's dtype; padding rows are zeros."""
        ...


@dataclasses.dataclass(frozen=True)
class ReferenceOps:
    """The `xla` forward: the kernels' jnp reference twins (`gdn.reference`, `paged_attention.reference`)."""

    name: str = "xla"

    def gdn_chunk(self, q, k, v, g, beta, h0) -> tuple[jax.Array, jax.Array]:
        """`Ops.gdn_chunk`: `gdn.reference.chunk_gated_delta_rule`."""
        return gdn_ref.chunk_gated_delta_rule(q, k, v, g, beta, h0)

    def gdn_rows(self, q, k, v, g, beta, h0) -> tuple[jax.Array, jax.Array]:
        """`Ops.gdn_rows`: `gdn.reference.recurrent_gated_delta_rule`."""
        return gdn_ref.recurrent_gated_delta_rule(q, k, v, g, beta, h0)

    def write_kv(
        self, k_cache, v_cache, k, v, block_tables, positions, null_block: int, layer=None
    ) -> tuple[jax.Array, jax.Array]:
        """`Ops.write_kv`: `paged_attention.reference.write_kv`."""
        return attn_ref.write_kv(k_cache, v_cache, k, v, block_tables, positions, null_block, layer)

    def attention(self, q, k_cache, v_cache, block_tables, positions, scale: float, layer=None) -> jax.Array:
        """`Ops.attention`: `paged_attention.reference.paged_attention`."""
        return attn_ref.paged_attention(q, k_cache, v_cache, block_tables, positions, scale, layer)


@dataclasses.dataclass(frozen=True)
class InvariantOps(ReferenceOps):
    """The `xla` forward in the batch-invariant mode (`--batch-invariant`): the reference twins with every
    contraction a `kernels_pallas.invariant.invariant_einsum` (a row's GDN step and its attention over the same
    keys give the same bits in a decode, a verify row or any batch), and `batch_invariant` set, which makes the
    engine trace the program's products through the rows kernel at every row count (`metrale_jax.model.invariant`).
    Bit-identity also needs XLA CPU's FMA contraction pinned (`metrale_jax.runtime_env.pin_fma_contraction`).
    The chunked GDN prefill is the reference's: its shapes are the chunk's whatever the prompt, so a prefill
    split on the GDN chunk grid runs the same chunk arithmetic as one pass."""

    name: str = "xla-batch-invariant"
    batch_invariant: bool = True

    def gdn_rows(self, q, k, v, g, beta, h0) -> tuple[jax.Array, jax.Array]:
        """`Ops.gdn_rows`: the recurrence with invariant contractions, each row from a fenced state."""
        return gdn_ref.recurrent_gated_delta_rule(q, k, v, g, beta, h0, invariant=True)

    def attention(self, q, k_cache, v_cache, block_tables, positions, scale: float, layer=None) -> jax.Array:
        """`Ops.attention`: the paged walk with `invariant_einsum` scores and PV, in blocks of at most
        `INVARIANT_QUERY_BLOCK` query tokens, each walking the key tiles up to its own last position.

        NOTE: a row's result does not depend on the rows walked with it, nor on the key tiles past its own
        position that its walk visits (a masked tile adds exact zeros: the contract's decode at position p walks
        to p's tile, the same row in a prefill to the prompt's last), so blocks of a long prefill give the one
        walk's bits while the tiles walked grow as a triangle rather than the square (half the work at 1024)."""
        t = q.shape[1]
        outs = [
            attn_ref.paged_attention(
                q[:, i : i + INVARIANT_QUERY_BLOCK],
                k_cache,
                v_cache,
                block_tables,
                positions[:, i : i + INVARIANT_QUERY_BLOCK],
                scale,
                layer,
                invariant=True,
            )
            for i in range(0, t, INVARIANT_QUERY_BLOCK)
        ]
        return outs[0] if len(outs) == 1 else jax.numpy.concatenate(outs, axis=1)


#: Query tokens per block of the batch-invariant attention (`InvariantOps.attention`): one key tile.
INVARIANT_QUERY_BLOCK = attn_ref.TILE_KEYS


_REFUSALS: dict[tuple[str, str], None] = {}  # (op, reason), insertion-ordered

# The tensor (heads) axis of the engine's mesh (`metrale_jax.model.linear.TENSOR_AXIS`).
_HEADS = "tp"


def _heads(*dims: int) -> P:
    """The PartitionSpec of an array of `len(dims)` axes whose axis `dims.index(1)` holds heads."""
    return P(*(_HEADS if d else None for d in dims))


def _on_heads(fn, in_specs: tuple, out_specs, *args):
    """fn(*args), or under a mesh whose tensor axis has several devices, fn on each device's heads
    (`jax.shard_map` over the context mesh; `in_specs` / `out_specs` name the head axes)."""
    mesh = jax.sharding.get_abstract_mesh()
    if dict(mesh.shape).get(_HEADS, 1) == 1:
        return fn(*args)
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)


# q, k [B, T, Hk, dk], v [B, T, H, dv], g, beta [B, T, H], h0 [B, H, dk, dv]: heads on axis 2 (h0: 1).
_GDN_IN = (
    _heads(0, 0, 1, 0),
    _heads(0, 0, 1, 0),
    _heads(0, 0, 1, 0),
    _heads(0, 0, 1),
    _heads(0, 0, 1),
    _heads(0, 1, 0, 0),
)
# q [B, T, H, D], caches [NB, bs, KV, D], block tables and positions replicated; out [B, T, H, D].
_ATTN_IN = (_heads(0, 0, 1, 0), _heads(0, 0, 1, 0), _heads(0, 0, 1, 0), P(), P())


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
    """The `pallas` forward: the Pallas kernels, each falling back to its reference when its
    `*_supported` check refuses the arguments. interpret: run the Pallas interpreter (the default
    off GPU)."""

    name: str = "pallas"
    interpret: bool = dataclasses.field(default_factory=common.default_interpret)
    #: The kernels' batch-invariant configuration (`PallasInvariantOps`); False: their defaults.
    batch_invariant: bool = False

    @property
    def backend(self) -> common.Backend:
        return common.backend_of(self.interpret)

    @staticmethod
    def refusals() -> tuple[str, ...]:
        """Every recorded refusal, one "op: reason" line each, oldest first."""
        return tuple(f"{op}: {reason}" for op, reason in _REFUSALS)

    def gdn_chunk(self, q, k, v, g, beta, h0) -> tuple[jax.Array, jax.Array]:
        """`Ops.gdn_chunk`: `gdn.api.chunk_gated_delta_rule`."""

        def run(*args):
            if _refused("gdn_chunk", gdn_api.gdn_chunk_supported(*args, backend=self.backend)):
                return gdn_api.chunk_gated_delta_rule(*args, implementation="reference")
            return gdn_api.chunk_gated_delta_rule(*args, interpret=self.interpret)

        return _on_heads(run, _GDN_IN, (_heads(0, 0, 1, 0), _heads(0, 1, 0, 0)), q, k, v, g, beta, h0)

    def gdn_rows(self, q, k, v, g, beta, h0) -> tuple[jax.Array, jax.Array]:
        """`Ops.gdn_rows`: `gdn.api.recurrent_gated_delta_rule`."""

        def run(*args):
            if _refused("gdn_rows", gdn_api.gdn_rows_supported(*args, backend=self.backend)):
                return gdn_api.recurrent_gated_delta_rule(
                    *args, implementation="reference", invariant=self.batch_invariant
                )
            return gdn_api.recurrent_gated_delta_rule(*args, interpret=self.interpret, invariant=self.batch_invariant)

        return _on_heads(run, _GDN_IN, (_heads(0, 0, 1, 0), _heads(0, 0, 1, 0, 0)), q, k, v, g, beta, h0)

    def write_kv(
        self, k_cache, v_cache, k, v, block_tables, positions, null_block: int, layer=None
    ) -> tuple[jax.Array, jax.Array]:
        """`Ops.write_kv`: the reference scatter on every backend."""
        return attn_api.write_kv(k_cache, v_cache, k, v, block_tables, positions, null_block, layer)

    def attention(self, q, k_cache, v_cache, block_tables, positions, scale: float, layer=None) -> jax.Array:
        """`Ops.attention`: `paged_attention.api.paged_attention`. With `layer`, the kernel gets
        that layer's slice of the stacked caches.
        NOTE: the kernel addresses one layer's cache (its offsets are int32), so the slice is taken
        here; XLA may materialise it (a per-step copy of the layer's KV the reference avoids)."""
        if layer is not None:
            k_cache, v_cache = k_cache[layer], v_cache[layer]

        def run(*args):
            supported = attn_api.paged_attention_supported(*args, backend=self.backend, invariant=self.batch_invariant)
            if _refused("attention", supported):
                return attn_api.paged_attention(
                    *args, scale, implementation="reference", invariant=self.batch_invariant
                )
            return attn_api.paged_attention(*args, scale, interpret=self.interpret, invariant=self.batch_invariant)

        return _on_heads(run, _ATTN_IN, _heads(0, 0, 1, 0), q, k_cache, v_cache, block_tables, positions)


@dataclasses.dataclass(frozen=True)
class PallasInvariantOps(PallasOps):
    """The `pallas` forward in the batch-invariant mode (`--batch-invariant`): the kernels in their
    batch-invariant configuration (`gdn.api`, `paged_attention.api`: fixed row blocks, and under the interpreter
    the invariant references' products and fences, so the rows and attention kernels equal `InvariantOps`' twins
    bit for bit), the chunk kernel as it is (its shapes are the chunk's whatever the prompt or batch; its 2-D
    dots equal the twin's batched ones at some dims only), and `batch_invariant` set: the engine traces the
    products through the rows kernel (`metrale_jax.model.invariant`) as for `InvariantOps`."""

    name: str = "pallas-batch-invariant"
    batch_invariant: bool = True
