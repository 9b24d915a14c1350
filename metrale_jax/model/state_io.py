"""Where the model's stateful operations read and write: the trunk state pool and the state IO.

Owns: `TrunkState` (the per-slot GDN recurrent state and conv window, the paged KV of the
full-attention layers, and the optional write-on-accept verify rows), `PoolIO`, the object the
trunk calls for every stateful op (GDN conv + core, KV write + attention), and `GdnMode`.

Invariants:
- A row reads only its own sequence's slot and blocks; padding rows (position < 0, rows >= lens)
  write only the dummy slot / null block / dummy verify rows, never a real one.
- `gdn_mode="chunk"` (prefill) keeps only each sequence's final state; `gdn_mode="rows"` (decode,
  verify) runs the recurrence row by row and, when verify rows are present, writes the state after
  every row but the last into the sequence's verify rows (write-on-accept) and the conv window after
  every row into its verify conv rows. The live slot always ends holding the state after the last
  valid row. With checkpoint pools present, a verify also writes each GDN layer's pre-verify live
  state and window into the sequence's checkpoint slot, layer by layer as the layer reads them
  (a copy of every layer at once would hold an [L_lin, B, ...] buffer for the whole program).
- Which implementation computes each op (jnp reference or Pallas kernel) is the `ops` object's
  business (an `Ops`: `kernels_pallas.ops`); this file never changes with the forward.
- Every kernel-backed op (GDN chunk, GDN rows, attention) runs between XLA optimization barriers
  on its array inputs and outputs (`_fenced`), so XLA compiles the model code around it the same
  whichever implementation runs inside; that is what makes the `pallas` forward byte-equal to
  the `xla` one on CPU (without the fence, XLA fuses e.g. GDN's sigmoid gate differently into
  each consumer and rounds it differently, by 1 ulp).
- The pool is updated in place: a read of a pool array that a later write of the same array
  could overtake goes through `ordered_read`, so XLA never copies a whole pool leaf (the engine
  counts such copies per program: `ProgramInfo.pool_copies`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import struct

from kernels_pallas.ops import Ops, ReferenceOps
from metrale_jax.config import ModelConfig
from metrale_jax.model import gdn as gdn_math

GdnMode = Literal["chunk", "rows"]  # how `PoolIO.gdn` runs the delta rule (see the module docstring)


def _fenced(op, *arrays):
    """op(*arrays) between optimization barriers on its inputs and its outputs."""
    return jax.lax.optimization_barrier(op(*jax.lax.optimization_barrier(arrays)))


def ordered_read(value, *arrays):
    """(value, arrays) through one optimization barrier: `value`, read from `arrays`, is then
    computed before anything can write `arrays` in place.

    NOTE: XLA copies a donated pool array (every layer, every slot) when it cannot order a read of
    it before the array's in-place write. `ProgramInfo.pool_copies` counts such copies.
    """
    return jax.lax.optimization_barrier((value, arrays))


class TrunkState(struct.PyTreeNode):
    """The trunk's pool, a frozen `flax.struct` pytree.

    gdn_h [L_lin, S, nv, dk, dv] (f32 or f16 pool); gdn_conv [L_lin, S, C, Kc] (both None in the
    drafter's state, which has attention layers only); kv_k / kv_v [L_full, NB, bs, KV, D];
    verify_h [L_lin, R_v, nv, dk, dv] or None; verify_conv [L_lin, S_v, K_v, C, Kc] or None;
    ckpt_h [L_lin, S_c, nv, dk, dv] / ckpt_conv [L_lin, S_c, C, Kc] or None (pre-verify
    checkpoints, replay rollback)."""

    gdn_h: jax.Array | None
    gdn_conv: jax.Array | None
    kv_k: jax.Array
    kv_v: jax.Array
    verify_h: jax.Array | None = None
    verify_conv: jax.Array | None = None
    ckpt_h: jax.Array | None = None
    ckpt_conv: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class PoolIO:
    """The per-call addressing of a batch of sequences into a `TrunkState`.

    slots [B] int32 (live GDN slot per sequence); lens [B] int32 (valid rows per sequence);
    positions [B, T] int32 (absolute position per row, -1 for padding); block_tables [B, MB] int32;
    null_block: the physical block padding rows write into; gdn_mode: how the delta rule runs (see
    the module docstring); ops: the forward's `Ops` (static); fresh [B] bool or None (sequences
    starting at position 0 read a zero state and window, whatever their slot held); verify
    addressing (only with gdn_mode="rows" and verify pools present): vrow_base [B] (first verify-h
    row of the sequence), vslot [B] (verify conv slot, and checkpoint slot where checkpoint pools
    are present).
    """

    cfg: ModelConfig
    slots: Any
    lens: Any
    positions: Any
    block_tables: Any
    null_block: int
    gdn_mode: GdnMode
    ops: Ops = ReferenceOps()
    fresh: Any = None
    vrow_base: Any = None
    vslot: Any = None

    def gdn(self, state: TrunkState, li: int, p, mixed, b, a):
        """Conv + delta rule for linear layer li. Returns (o [B, T, nv, dv] f32, new state)."""
        cfg = self.cfg
        assert state.gdn_h is not None and state.gdn_conv is not None, "a GDN layer needs the GDN pools"
        (h0, w0), (gdn_h, gdn_conv) = ordered_read(
            (state.gdn_h[li, self.slots], state.gdn_conv[li, self.slots]), state.gdn_h, state.gdn_conv
        )
        state = state.replace(gdn_h=gdn_h, gdn_conv=gdn_conv)
        if self.vslot is not None and state.ckpt_h is not None:
            assert state.ckpt_conv is not None
            state = state.replace(
                ckpt_h=state.ckpt_h.at[li, self.vslot].set(h0), ckpt_conv=state.ckpt_conv.at[li, self.vslot].set(w0)
            )
        h0 = h0.astype(jnp.float32)
        if self.fresh is not None:
            h0 = jnp.where(self.fresh[:, None, None, None], 0.0, h0)
            w0 = jnp.where(self.fresh[:, None, None], jnp.zeros_like(w0), w0)
        y, windows, final_w = gdn_math.causal_conv(mixed, w0, p["conv"], self.lens)
        q, k, v = gdn_math.split_qkv(y, cfg)
        beta, g = gdn_math.gates(p, b, a)
        k, beta, g = gdn_math.mask_rows(k, beta, g, self.lens)
        hdt = gdn_h.dtype
        if self.gdn_mode == "chunk":
            o, h_final = _fenced(self.ops.gdn_chunk, q, k, v, g, beta, h0)
        else:
            o, rows = _fenced(self.ops.gdn_rows, q, k, v, g, beta, h0)
            last = jnp.maximum(self.lens - 1, 0)
            h_final = jnp.take_along_axis(rows, last[:, None, None, None, None], axis=1)[:, 0]
            h_final = jnp.where((self.lens > 0)[:, None, None, None], h_final, h0)
            if state.verify_h is not None and self.vrow_base is not None:
                state = self._write_verify_rows(state, li, rows.astype(hdt), windows)
        state = state.replace(
            gdn_h=gdn_h.at[li, self.slots].set(h_final.astype(hdt)),
            gdn_conv=gdn_conv.at[li, self.slots].set(final_w),
        )
        return o, state

    def _write_verify_rows(self, state, li, rows, windows):
        """Write-on-accept: verify_h gets the state after rows 0..lens-2, verify_conv the window
        after rows 0..lens-1; everything else goes to the dummy rows (row 0 of the dummy slot)."""
        b, t = rows.shape[:2]
        r = jnp.arange(t)[None, :]
        dummy_row = state.verify_h.shape[1] - 1
        h_dst = jnp.where(r < self.lens[:, None] - 1, self.vrow_base[:, None] + r, dummy_row)
        dummy_vslot = state.verify_conv.shape[1] - 1
        kv = state.verify_conv.shape[2]
        c_ok = (r < self.lens[:, None]) & (r < kv)
        c_slot = jnp.where(c_ok, self.vslot[:, None], dummy_vslot)
        c_row = jnp.where(c_ok, r, 0)
        win = windows.astype(state.verify_conv.dtype)  # [B, T, C, Kc]
        return state.replace(
            verify_h=state.verify_h.at[li, h_dst].set(rows),
            verify_conv=state.verify_conv.at[li, c_slot, c_row].set(win),
        )

    def attention(self, state: TrunkState, ai: int, q, k, v):
        """Write rows' K/V into layer ai's blocks, then attend. Returns (o [B, T, H, D], state).

        NOTE: the write scatters into the stacked [L, NB, ...] cache and the fence passes the whole
        stacked cache with the layer index to the op: no layer's KV is copied per step.
        """
        kv_k, kv_v = self.ops.write_kv(
            state.kv_k, state.kv_v, k, v, self.block_tables, self.positions, self.null_block, ai
        )
        scale = self.cfg.head_dim**-0.5
        o = _fenced(
            lambda q, kk, vv, bt, pos: self.ops.attention(q, kk, vv, bt, pos, scale, layer=ai),
            q,
            kv_k,
            kv_v,
            self.block_tables,
            self.positions,
        )
        return o, state.replace(kv_k=kv_k, kv_v=kv_v)
