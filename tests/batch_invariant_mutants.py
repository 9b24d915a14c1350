"""The sub-bound mutants (`diff_mutants.SUB_BOUND_MUTANTS`) against the oracle, bounded and under --batch-invariant,
in a process with FMA contraction pinned (`tests/test_batch_invariant.py` starts it). Prints one JSON object
{"bounded" | "invariant": {"clean" | mutant: [verdict, the oracle's contract, first violation or None]}}.
"""

from __future__ import annotations

import json

from diff_mutants import SUB_BOUND_MUTANTS, MutantEngine, planted

from metrale_jax.diff import DiffRequest, run_diff
from metrale_jax.diff.oracle import ORACLE
from metrale_jax.diff.variants import default_variants
from metrale_jax.engine.settings import resolve_settings
from metrale_jax.presets import resolve_checkpoint

VERIFY = DiffRequest(steps=3, verify_batch=(3,), verify_batch_ks=(4,), mtp=True)
cfg, params = resolve_checkpoint("tiny")
out: dict[str, dict] = {}
for mode, on in (("bounded", False), ("invariant", True)):
    flags = dict(max_batch_size="8", max_seq_len=128, speculative=True, num_drafts=3, kv_cache_dtype="f32")
    engine = MutantEngine(cfg, params, resolve_settings({**flags, "batch_invariant": on}, None, auto_slots=8))
    rows = {}
    for name in ("clean", *SUB_BOUND_MUTANTS):
        if name == "clean":
            report = run_diff(engine, VERIFY, default_variants([ORACLE])[0])
        else:
            with planted(engine, name):
                report = run_diff(engine, VERIFY, default_variants([ORACLE])[0])
        (c,) = report["shapes"][0]["comparisons"]
        rows[name] = [report["verdict"], c["contract"], c["first_violation"]]
    out[mode] = rows
print(json.dumps(out))
