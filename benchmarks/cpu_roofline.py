"""The CPU roofline of the hf sections: per decode and verify step, the bytes the step must move over this
core's streaming-read bandwidth, measured in the same run, next to the measured step times.

Owns: `read_bandwidth` (bytes per second of one streaming read of a float32 buffer, on the calling thread),
`Bandwidths` (the figures of one section: a buffer past the last-level cache once, and one the size of each
step's touched weights) and `step_roofline` (one step's bytes, floor and ratios).

Bytes (`roofline.step_bytes`, "must move", at the engine's dtypes): the weights the step touches (every
mixer, norm, router and shared expert; the routed experts the step's rows reach: exactly top_k per MoE
layer for one row, and for more rows the expectation under uniform routing, E (1 - (1 - k/E)^rows); the
lm_head and the gathered embedding rows; for a speculative engine the MTP drafter's fc and layer, whose
catch-up runs in every trunk step), the GDN state and conv window read and written per sequence (verify:
plus the pre-verify checkpoint and the write-on-accept rows), every live key and value read and the new
rows written, and the f32 logits written.

Floor = bytes / the bandwidth of a read of a buffer the size of the touched weights (the weights a step
re-reads are in whatever cache level a buffer of that size lives in); the read past the cache is reported
next to it. ratio = floor / measured: 1 is the memory-bandwidth bound, 0.5 is "within 2x of it".

Invariant: nothing here asserts on time; the figures are reported.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from benchmarks.roofline import step_bytes

#: The streaming read past the last-level cache: larger than this VM's 480 MiB L3.
PAST_CACHE_BYTES = 1 << 30


def read_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes per second of one streaming read of a float32 buffer of `nbytes` (rounded to whole floats),
    best of `repeats` after one untimed pass (which also faults the pages in).

    NOTE: the read is a BLAS dot of the buffer with itself (single-threaded under the benchmark's thread
    settings): both operands are the same cache lines, so every byte crosses the memory bus once, and the
    dot keeps up with the bus where numpy's pairwise `sum` does not."""
    buf = np.ones(max(nbytes // 4, 1024), np.float32)
    np.dot(buf, buf)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.dot(buf, buf)
        best = min(best, time.perf_counter() - t0)
    return buf.nbytes / best


@dataclasses.dataclass
class Bandwidths:
    """One section's measured read bandwidths: `past_cache` (a `PAST_CACHE_BYTES` buffer) and, per size, a
    buffer of that size (`at(nbytes)`, measured once per size within 1/16 of it)."""

    past_cache: float
    sized: dict[int, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def measure(cls) -> Bandwidths:
        return cls(read_bandwidth(PAST_CACHE_BYTES))

    def at(self, nbytes: int) -> float:
        for size, bw in self.sized.items():
            if abs(size - nbytes) * 16 <= nbytes:
                return bw
        self.sized[nbytes] = read_bandwidth(nbytes)
        return self.sized[nbytes]


def step_roofline(
    bandwidths: Bandwidths, cfg, settings, *, n: int, t: int, ctx: int, verify: bool, drafter: bool, weight_bytes: int
) -> dict:
    """The roofline of one engine step (n sequences x t rows over ctx cached tokens): its bytes (the
    `roofline.step_bytes` dict), the two bandwidths (bytes/s) and the floor (seconds) at the bandwidth of
    a buffer the size of its touched weights."""
    by = step_bytes(cfg, settings, n=n, t=t, ctx=ctx, verify=verify, drafter=drafter, weight_bytes=weight_bytes)
    hot = bandwidths.at(int(by["weights_must"]))
    return {
        "bytes": by,
        "bandwidth_past_cache": bandwidths.past_cache,
        "bandwidth_weights_sized": hot,
        "floor_s": by["total_must"] / hot,
        "floor_past_cache_s": by["total_must"] / bandwidths.past_cache,
    }
