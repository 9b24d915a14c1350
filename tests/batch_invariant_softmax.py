"""The softmaxes of the batch-invariant mode against the rows around them, in a process with FMA contraction
pinned (`tests/test_batch_invariant.py` starts it). Prints one JSON object {case: [row counts at which one of the
first rows has other bits than it has computed alone]}: the fenced forms (`reductions.fenced`, `log_softmax(x,
True)`, the sampling law `sampling.probabilities` traced in the mode) and, as the control, the unfenced ones they
replace.
"""

from __future__ import annotations

import json

ROW_COUNTS = (2, 16, 64, 512, 1024)
ROWS_ALONE = 16  # the first rows, each computed alone, against the same rows among ROW_COUNTS


def main() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels_pallas.reductions import fenced, log_softmax
    from metrale_jax.engine.sampling import SamplingRows, probabilities
    from metrale_jax.model.invariant import batch_invariant_products

    def router(fence: bool):  # the MoE router's softmax numerator over 8 experts
        return lambda x: jnp.exp(x - fenced(jnp.max(x, axis=-1, keepdims=True), fence))

    def sampled(invariant: bool):  # the law a sampled row draws from (T 0.8), traced in the mode or not
        def law(x):
            rows = SamplingRows.padded(None, x.shape[0])
            rows.temperature[:] = np.float32(0.8).view(np.int32)
            with batch_invariant_products(invariant):
                return probabilities(x, rows)

        return law

    cases = {
        "router exp(x - max), fenced": (8, router(True)),
        "router exp(x - max), unfenced": (8, router(False)),
        "log_softmax, invariant": (2048, lambda x: log_softmax(x, True)),
        "log_softmax, jax": (2048, lambda x: log_softmax(x, False)),
        "sampling probabilities, invariant": (2048, sampled(True)),
        "sampling probabilities, default": (2048, sampled(False)),
    }
    out = {}
    for name, (width, fn) in cases.items():
        x = 3 * jax.random.normal(jax.random.key(6), (max(ROW_COUNTS), width), jnp.float32)
        f = jax.jit(fn)
        alone = np.concatenate([np.asarray(f(x[i : i + 1])) for i in range(ROWS_ALONE)])
        out[name] = [n for n in ROW_COUNTS if np.asarray(f(x[:n]))[:ROWS_ALONE].tobytes() != alone[:n].tobytes()]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
