"""Print the logit parity of the JAX model against the HF golden fixtures (f32 and bf16).

Usage: .venv/bin/python scripts/hf_parity_report.py
BUILD_NOTES.md (Current results) summarises the table; the pass/fail bounds live in tests/test_hf_parity.py.
"""

import os

import jax.numpy as jnp
import numpy as np

from metrale_jax.checkpoint import load_checkpoint
from metrale_jax.model.cache import prefill_and_decode

ROOT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "hf")


def main():
    print(
        "| fixture | f32 max abs | f32 max rel (/max|logit|) | bf16 median | bf16 p99 | bf16 max "
        "| bf16 argmax agree | HF's own bf16-vs-f32 median / max |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in sorted(os.listdir(ROOT)):
        d = os.path.join(ROOT, name)
        if not os.path.isdir(d):
            continue
        g = np.load(os.path.join(d, "golden.npz"))
        p, toks = int(g["prompt_len"]), g["tokens"]
        out = {}
        for key, dt in (("logits_f32", np.float32), ("logits_bf16", jnp.bfloat16)):
            cfg, params = load_checkpoint(d, dt)
            lg, _ = prefill_and_decode(params, cfg, toks[:p], len(toks) - p, feed=toks[p:])
            out[key] = np.asarray(lg)
        e32 = np.abs(out["logits_f32"] - g["logits_f32"])
        e16 = np.abs(out["logits_bf16"] - g["logits_bf16"])
        hf = np.abs(g["logits_bf16"] - g["logits_f32"])
        agree = np.mean(out["logits_bf16"].argmax(1) == g["logits_bf16"].argmax(1))
        print(
            f"| {name} | {e32.max():.2e} | {e32.max() / np.abs(g['logits_f32']).max():.2e} | {np.median(e16):.4f} | "
            f"{np.percentile(e16, 99):.3f} | {e16.max():.3f} | {agree:.3f} | {np.median(hf):.4f} / {hf.max():.3f} |"
        )


if __name__ == "__main__":
    main()
