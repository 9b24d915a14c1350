"""`invariant_einsum` against the materialised tree it stands for, in a process with FMA contraction pinned
(`tests/test_batch_invariant.py` starts it; unpinned, XLA may contract a leaf's product into the add above it).
Prints one JSON object {case: whether the bits of `invariant_einsum` are those of `pairwise_sum` over the
broadcast product with the summed index last}.
"""

from __future__ import annotations

import json

# spec, a's shape, b's shape: the GDN state read by a key, attention scores (d both operands' minor), PV over a
# value tile; the unrolled tree at powers of two, the materialised product at other lengths.
CASES = (
    ("bhkv,bhk->bhv", (8, 3, 16, 12), (8, 3, 16)),
    ("bgmd,bgsd->bgms", (2, 2, 8, 16), (2, 2, 64, 16)),
    ("bgms,bgsd->bgmd", (2, 2, 8, 64), (2, 2, 64, 16)),
    ("bhkv,bhk->bhv", (8, 3, 12, 16), (8, 3, 12)),
    ("bgms,bgsd->bgmd", (2, 2, 8, 24), (2, 2, 24, 16)),
)


def case_name(spec: str, a_shape: tuple, b_shape: tuple) -> str:
    return f"{spec} {a_shape} {b_shape}"


def main() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels_pallas.invariant import invariant_einsum
    from kernels_pallas.reductions import pairwise_sum

    out = {}
    for spec, a_shape, b_shape in CASES:
        a = jax.random.normal(jax.random.key(4), a_shape, jnp.float32)
        b = jax.random.normal(jax.random.key(5), b_shape, jnp.float32)
        inputs, result = spec.split("->")
        summed = next(c for c in inputs if c not in result and c != ",")
        got = jax.jit(lambda a, b, spec=spec: invariant_einsum(spec, a, b))(a, b)
        tree = jax.jit(lambda a, b, e=f"{inputs}->{result}{summed}": pairwise_sum(jnp.einsum(e, a, b)))(a, b)
        out[case_name(spec, a_shape, b_shape)] = np.asarray(got).tobytes() == np.asarray(tree).tobytes()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
