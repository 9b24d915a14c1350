"""`PallasOps`, the `pallas` forward's ops object, against `ReferenceOps` (the `xla` forward).

Claims: it is a frozen, hashable stand-in with ReferenceOps' methods, interpreting off GPU; its GDN
and attention methods meet the kernels' contract against ReferenceOps' (byte-equal under the
interpreter, bounded compiled); a refused op runs the reference and is recorded (and warned about
once); under the interpreter the tiny model's cached forward (prefill, then decode) gives
byte-equal logits with either ops object.
"""

import inspect
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import common, testing
from kernels_pallas.ops import PallasOps, ReferenceOps
from metrale_jax.model.cache import forward_jit, new_cache


def test_is_a_static_ops_object():
    ops = PallasOps()
    assert ops.name == "pallas" and ops.interpret is common.default_interpret()
    assert ops.backend == common.backend_of(common.default_interpret())
    assert hash(ops) == hash(PallasOps()) and ops == PallasOps()
    with pytest.raises(AttributeError):
        ops.interpret = False
    for name in ("gdn_chunk", "gdn_rows", "write_kv", "attention"):
        assert list(inspect.signature(getattr(PallasOps, name)).parameters) == list(
            inspect.signature(getattr(ReferenceOps, name)).parameters
        )


def test_methods_match_reference_ops():
    rng = np.random.default_rng(3)
    ops, ref = PallasOps(), ReferenceOps()
    for method, t in (("gdn_rows", 4), ("gdn_chunk", 70)):
        args = testing.gdn_inputs(rng, 2, t, 1, 2, 8, 16, initial_state=True)
        oracles = testing.gdn_oracles(args, chunk=method == "gdn_chunk")
        for x, y, x64 in zip(getattr(ops, method)(*args), getattr(ref, method)(*args), oracles):
            testing.assert_contract(x, y, x64, interpret=ops.interpret)
    inputs = testing.attention_inputs(rng, np.float32, b=2, t=3, h=4, kvh=2, d=16, bs=4, nb=12, mb=4, starts=[2, 9])
    q, kc, vc, tables, pos = map(jnp.asarray, inputs)
    kc, vc = ops.write_kv(kc, vc, q[:, :, :2], q[:, :, 2:], tables, pos, 11)
    testing.assert_contract(
        ops.attention(q, kc, vc, tables, pos, 0.25),
        ref.attention(q, kc, vc, tables, pos, 0.25),
        lambda: testing.attention_oracle(q, kc, vc, tables, pos, 0.25),
        interpret=ops.interpret,
    )


def test_refusal_falls_back_and_is_recorded():
    args = testing.gdn_inputs(np.random.default_rng(4), 1, 9, 1, 2, 8, 16, initial_state=True)  # 9 rows > 8
    ops = PallasOps()
    with pytest.warns(UserWarning, match="gdn_rows runs the reference"):
        out = ops.gdn_rows(*args)
    for x, y in zip(out, ReferenceOps().gdn_rows(*args)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert any(line.startswith("gdn_rows: ") and "at most 8 rows" in line for line in PallasOps.refusals())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.gdn_rows(*args)  # recorded once, warned once


def test_tiny_model_forward_agrees(tiny):
    if not common.default_interpret():
        pytest.skip("byte-equal forwards are the interpreter's contract; compiled kernels are bounded")
    cfg, params = tiny
    prompt = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 21)), jnp.int32)
    runs = {}
    for ops in (ReferenceOps(), PallasOps()):
        cache = new_cache(cfg, 2, 24)
        logits, _, cache = forward_jit(params, cfg, prompt, cache, jnp.int32(0), ops=ops)
        steps = [logits]
        for i in range(2):
            tok = jnp.argmax(steps[-1][:, -1:], axis=-1).astype(jnp.int32)
            logits, _, cache = forward_jit(params, cfg, tok, cache, jnp.int32(21 + i), ops=ops)
            steps.append(logits)
        runs[ops.name] = np.concatenate([np.asarray(x) for x in steps], axis=1)
    np.testing.assert_array_equal(runs["pallas"], runs["xla"])
