"""The batch-invariant contract on one model, run in a process whose XLA CPU has FMA contraction pinned
(`tests/test_batch_invariant.py` starts it with `runtime_env.FMA_PIN_FLAG` in XLA_FLAGS).

Prints one JSON object {check: [compared, differing]} (differing: names of the parts whose bytes differ).
argv: checkpoint (a preset, a checkpoint directory or a `model_registry` model), KV cache dtype, and optionally the
forward (`xla`, the default, or `pallas`: the kernels' batch-invariant configuration, interpreted).
"""

from __future__ import annotations

import json
import sys

import numpy as np

from metrale_jax.engine.engine import Engine
from metrale_jax.engine.settings import resolve_settings
from metrale_jax.model_registry import config, is_synthetic
from metrale_jax.params import init_params
from metrale_jax.presets import resolve_checkpoint

CHECKPOINT, KV = sys.argv[1], sys.argv[2]
FORWARD = sys.argv[3] if len(sys.argv) > 3 else "xla"
if is_synthetic(CHECKPOINT):  # a benchmark model (`qwen3-next-h512`: hidden 512, MoE), seeded as the benchmarks seed it
    cfg = config(CHECKPOINT)
    params = init_params(cfg, 0)
else:
    cfg, params = resolve_checkpoint(CHECKPOINT)
_rng = np.random.default_rng(5)
PROMPTS = [[int(x) for x in _rng.integers(0, cfg.vocab_size, size=n)] for n in (70, 21, 9, 40, 33, 12, 5, 50)]
ROWS = [11, 12, 13, 14]  # a verify's rows: last token, then three drafts
out: dict[str, list] = {}


def engine(max_seq_len: int = 256) -> Engine:
    flags = dict(max_batch_size="8", max_seq_len=max_seq_len, speculative=True, num_drafts=3, kv_cache_dtype=KV)
    settings = resolve_settings({**flags, "batch_invariant": True}, None, auto_slots=8)
    return Engine(cfg, params, settings, forward=FORWARD)


def bits(x) -> bytes:
    return np.ascontiguousarray(np.asarray(x)).tobytes()


def state(eng: Engine, seq) -> dict:
    """A sequence's recurrent state, stash and its KV at positions < seq_len (the rows a later step reads)."""
    rec = eng.save_sequence_state(seq).device
    bs = rec.kv_k.shape[2]
    n = seq.seq_len
    kv = lambda a: a.reshape(a.shape[0], -1, *a.shape[3:])[:, :n]  # noqa: E731
    parts = {"gdn_h": rec.gdn_h, "gdn_conv": rec.gdn_conv, "kv_k": kv(rec.kv_k), "kv_v": kv(rec.kv_v)}
    assert rec.kv_k.shape[1] * bs >= n
    if rec.stash is not None:
        parts["stash"] = rec.stash
    return parts


def check(name: str, a: dict, b: dict) -> None:
    differing = [k for k in a if bits(a[k]) != bits(b[k])]
    out[name] = [len(a), differing]


def prefilled(eng: Engine, n: int, fragment: bool = False):
    if fragment:  # a hole in the slots: the sequence under test lands on a later slot
        spacer = [eng.alloc_sequence() for _ in range(3)]
    seqs = [eng.alloc_sequence() for _ in range(n)]
    if fragment:
        for s in spacer:
            eng.free_sequence(s)
    for s, p in zip(seqs, PROMPTS):
        eng.prefill(s, p, 32)
    return seqs


# 1. A decode does not depend on its batch (n = 1, 4, 8; fragmented slots).
alone = engine()
(a,) = prefilled(alone, 1)
ref = {"logits": alone.decode(a, 5), **state(alone, a)}
for n in (4, 8):
    eng = engine()
    seqs = prefilled(eng, n, fragment=n == 4)
    x = eng.decode_batch(seqs, [5, *range(6, 6 + n - 1)])
    check(f"decode alone == in a batch of {n}", ref, {"logits": x[0], **state(eng, seqs[0])})

# 2. Verify row j == the decode after rows 0..j-1; the state committed after the verdict == plain decodes.
plain = engine()
(b,) = prefilled(plain, 1)
decodes = []
for t in ROWS:
    decodes.append(plain.decode(b, t))
    if len(decodes) == 3:
        after_three = state(plain, b)
spec = engine()
seqs = prefilled(spec, 3)
logits, _ = spec.verify_batched(seqs, [t for _ in seqs for t in ROWS], [4, 4, 4])
for j in range(4):
    check(f"verify row {j} == decode", {"logits": decodes[j]}, {"logits": logits[j]})
spec.accept(seqs, [2, 0, 1])  # sequence 0 keeps rows 0..2
check("committed state after the verdict == plain decodes", after_three, state(spec, seqs[0]))

# 3. A prefill in chunks of the GDN chunk's multiples == one pass (logits and state).
one = engine()
s1 = one.alloc_sequence()
whole = {"logits": one.prefill(s1, PROMPTS[0] + PROMPTS[3])}
whole.update(state(one, s1))
for chunk in (32, 64):
    eng = engine()
    s = eng.alloc_sequence()
    check(
        f"prefill in chunks of {chunk} == one pass",
        whole,
        {"logits": eng.prefill(s, PROMPTS[0] + PROMPTS[3], chunk), **state(eng, s)},
    )

# 3b. A long prompt (past the sizes where XLA CPU fuses a softmax's max with its exponentials otherwise).
LONG = [int(x) for x in _rng.integers(0, cfg.vocab_size, size=600)]
one = engine(max_seq_len=640)
s1 = one.alloc_sequence()
whole = {"logits": one.prefill(s1, LONG)}
whole.update(state(one, s1))
s = one.alloc_sequence()
check("prefill of 600 in chunks of 64 == one pass", whole, {"logits": one.prefill(s, LONG, 64), **state(one, s)})

# 4. The MTP propose does not depend on its batch.
e1, e4 = engine(), engine()
(p1,) = prefilled(e1, 1)
p4 = prefilled(e4, 4)
d1, c1, x1 = e1.propose_batched([p1], [7], 3)
d4, c4, x4 = e4.propose_batched(p4, [7, 8, 9, 10], 3)
check(
    "propose alone == in a batch of 4",
    {"drafts": d1[0], "conf": c1[0], "logits": x1[0]},
    {"drafts": d4[0], "conf": c4[0], "logits": x4[0]},
)
print(json.dumps(out))
