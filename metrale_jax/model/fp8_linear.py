"""FP8 block-scaled weights (the `quant_method: fp8` releases) and their products.

Owns: `Fp8BlockWeight`, one projection leaf held as the checkpoint ships it (e4m3 values, as their
bytes, and one scale per block), `e4m3_bits` (an e4m3 array as those bytes) and `dense_weight`, the
one point at which `metrale_jax.model.linear`'s products turn such a leaf into the activation dtype.

Invariants:
- `w ≈ q · scale[r // rows_per_scale, c // cols_per_scale]` for the first `q.shape[-2]` rows;
  the leaf's remaining rows (`tail`, possibly none) are the rows the release keeps at full
  precision (e.g. the GDN's `in_proj_b` / `in_proj_a`), stored as they are.
- The model is never held dequantised: each product dequantises its own weight inside the step
  program (a transient of that one product, in the activation dtype) and multiplies; between
  products only the e4m3 values and the scales live.
- Under a tensor axis of N groups a leaf with kept rows is group-major over both kinds
  (`metrale_jax.engine.sharding`): the values' rows and the kept rows each in N groups; the
  dequantised weight interleaves them group by group (`dequantise(dtype, groups=N)`), so every
  device's rows stay its own and the product's split (`linear.split_groups`) sees one group-major leaf.
- `q` holds the e4m3 values' bytes (uint8, `BITS_DTYPE`); only `dequantise` reads them as e4m3.
  NOTE: XLA CPU has no e4m3 kernels but the conversion: it rewrites any other op on an e4m3
  array (a dynamic index, a slice, a barrier) into f16 after converting the whole operand, and
  out of the MoE's per-pair loop that conversion is hoisted: every layer's expert stack in f16 at
  once (the planner measured 155 GB for the 80B FP8's decode). Bytes slice and index as bytes.
- The dequantised value is `(f32(q) * f32(scale))` cast to the activation dtype: what a CPU
  reference that dequantises per block and multiplies in bf16/f32 computes (not the GPU engines'
  dynamic per-token activation quantisation, whose result differs by the activation's rounding).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import struct

#: The dtype of a converted weight's values (safetensors `F8_E4M3`).
FP8_DTYPE = ml_dtypes.float8_e4m3fn
#: How `Fp8BlockWeight.q` holds them: their bytes.
BITS_DTYPE = jnp.uint8


def e4m3_bits(values: np.ndarray) -> np.ndarray:
    """An e4m3 numpy array as its bytes (`BITS_DTYPE`, no copy), the form `Fp8BlockWeight.q` holds."""
    return values.view(np.uint8)


@struct.dataclass
class Fp8BlockWeight:
    """A weight [..., out, in] as e4m3 values `q` [..., out_q, in] (their bytes) with `scale`
    [..., ceil(out_q / block[0]), ceil(in / block[1])], then `tail` [..., out - out_q, in] (rows
    kept at full precision; None when there are none). `block` is static."""

    # Arrays; shape structs where the memory planner lays out abstract weights.
    q: Any
    scale: Any
    tail: Any = None
    block: tuple[int, int] = struct.field(pytree_node=False, default=(128, 128))

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape [..., out, in]."""
        rows = self.q.shape[-2] + (0 if self.tail is None else self.tail.shape[-2])
        return (*self.q.shape[:-2], rows, self.q.shape[-1])

    @property
    def dtype(self):
        """The dtype of the converted rows' values (e4m3; `q` holds their bytes)."""
        return FP8_DTYPE

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def map(self, fn) -> Fp8BlockWeight:
        """The same weight with `fn` applied to each of its arrays' leading (non-matrix) axes:
        fn(array) must keep the last two axes (e.g. pick an expert)."""
        return Fp8BlockWeight(fn(self.q), fn(self.scale), None if self.tail is None else fn(self.tail), self.block)

    def __getitem__(self, index) -> Fp8BlockWeight:
        """Index the leading axes, e.g. `w[..., e, :, :]` (one expert of a stack): `index` must end
        with the two full matrix slices."""
        return self.map(lambda a: a[index])

    def dequantise(self, dtype, groups: int = 1) -> jax.Array:
        """The [..., out, in] weight in `dtype`: each block's values times its scale, in f32, cast;
        the kept rows after the values' rows in each of `groups` row groups (1: after all of them)."""
        rows, cols = self.q.shape[-2:]
        rb, cb = self.block
        scale = jnp.repeat(jnp.repeat(self.scale, rb, axis=-2)[..., :rows, :], cb, axis=-1)[..., :cols]
        values = jax.lax.bitcast_convert_type(self.q, FP8_DTYPE)
        w = (values.astype(jnp.float32) * scale.astype(jnp.float32)).astype(dtype)
        if self.tail is None:
            return w
        lead = w.shape[:-2]
        w = w.reshape(*lead, groups, rows // groups, cols)
        tail = self.tail.astype(dtype).reshape(*lead, groups, -1, cols)
        return jnp.concatenate([w, tail], axis=-2).reshape(*self.shape)


def dense_weight(w, x, groups: int = 1):
    """`w` as an array for a product with activations `x` (in x's dtype): an `Fp8BlockWeight`
    dequantised (inside the calling program; see the header; `groups`: its row groups, the
    tensor axis's shards for a group-major leaf), anything else as it is.
    NOTE: the barrier orders the dequantisation after x: the values depend on no activation, and
    XLA CPU scheduled every layer's dequantised copy at the program's start (the planner measured
    152 GB of temporaries, the model in bf16, for the 80B FP8 prefill). A no-op on values."""
    if not isinstance(w, Fp8BlockWeight):
        return w
    _, w = jax.lax.optimization_barrier((x, w))
    return w.dequantise(x.dtype, groups)
