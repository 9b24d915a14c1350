"""Sums over short axes written as explicit adds.

Owns: `ordered_sum`. Invariant: terms are added left to right (index 0 first), in the input's
dtype, whatever the array's shape.

NOTE: XLA CPU runs a reduction over a narrow axis (the GDN conv's 4 taps, the MoE's top-k
routing weights) as a library call, ~35 us each in a tiny verify step; a chain of elementwise
adds fuses into its neighbours.
"""

from __future__ import annotations


def ordered_sum(x, axis: int):
    """sum(x, axis) as x[0] + x[1] + ... along `axis` (meant for axes of a few elements)."""
    terms = [x.take(i, axis=axis) for i in range(x.shape[axis])]
    out = terms[0]
    for term in terms[1:]:
        out = out + term
    return out
