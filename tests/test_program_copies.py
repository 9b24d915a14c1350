"""Every step program reads the weights in place and updates the pool in place: zero
`ProgramInfo.param_copies` and `pool_copies` in the list layout, for both forwards, at the
benchmark widths of `qwen3-next-h512`; the scan layout materialises each group's weights, and the
accounting sees it. `count_param_copies` itself on small programs whose copies are known."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import settings

from metrale_jax.engine.engine import FORWARDS, Engine
from metrale_jax.engine.programs import compile_transition, count_param_copies
from metrale_jax.model_registry import config
from metrale_jax.params import init_params

WIDE = config("qwen3-next-h512")
STEPS = {"prefill_chunk", "step_rows", "stash_rows", "gdn_fold", "commit_conv", "propose", "restore_ckpt"}


@pytest.fixture(scope="module")
def params():
    return init_params(WIDE, 0)


def _every_step(eng: Engine) -> None:
    """Prefill 8 sequences; decode 1 and 8; verify 8 x K = 4, its verdict (stash, fold, commit)
    and a propose; a fused speculative step; a verify rolled back."""
    rng = np.random.default_rng(0)
    seqs = [eng.alloc_sequence() for _ in range(8)]
    for s in seqs:
        eng.prefill(s, rng.integers(0, WIDE.vocab_size, 24).tolist())
    eng.decode(seqs[0], 1)
    eng.decode_batch(seqs, [2] * 8)
    eng.verify_batched(seqs, [3, 4, 5, 6] * 8, [4] * 8)
    eng.accept(seqs, [1] * 8)
    eng.propose_batched(seqs, [7] * 8, 3)
    eng.speculative_step(seqs, [8, 9, 10, 11] * 8, [4] * 8, 3)
    eng.verify_batched(seqs, [3, 4, 5, 6] * 8, [4] * 8)
    eng.rollback_verify(seqs)


@pytest.mark.parametrize("forward", FORWARDS)
def test_list_layout_programs_copy_nothing(params, forward):
    eng = Engine(
        WIDE, params, settings(max_batch_size=8, max_seq_len=128, speculative=True, num_drafts=3), forward=forward
    )
    _every_step(eng)
    infos = list(eng.programs.info.values())
    assert {i.name for i in infos} >= STEPS | {"speculative_step"}
    assert [(i.name, i.param_copies, i.pool_copies) for i in infos if i.param_copies or i.pool_copies] == []


def test_scan_layout_copies_each_group_and_the_accounting_sees_it(params):
    """qwen3-next-h512 is 2 groups of 4 layers: the trunk's programs copy group slices of the
    stacked weights out at every step; the pool is still updated in place."""
    eng = Engine(WIDE, params, settings(max_batch_size=8, max_seq_len=128), layout="scan")
    seq = eng.alloc_sequence()
    eng.prefill(seq, [1, 2, 3])
    eng.decode(seq, 4)
    infos = list(eng.programs.info.values())
    assert {i.name for i in infos} == {"prefill_chunk", "step_rows"}
    assert all(i.param_copies > 0 and i.pool_copies == 0 for i in infos)


def _copies(fn, *args) -> int:
    """count_param_copies of `fn(pool, params, x)` compiled as the engine compiles a transition."""
    return count_param_copies(compile_transition(fn, None, args).as_text())


def test_count_param_copies_on_known_programs():
    w = jnp.asarray(np.random.default_rng(0).standard_normal((4, 96, 64)), jnp.float32)
    x, pool = jnp.ones((3, 64)), jnp.zeros((2, 2))

    def stacked(pool, params, x):  # a loop over a leaf stacked over groups: each step slices its group out
        layers = params["layer_groups"][0]["w"]
        return pool + 1, jax.lax.fori_loop(0, 4, lambda g, h: jnp.tanh(h @ layers[g].T)[:, :64], x)

    def listed(pool, params, x):  # the same layers as separate leaves, read in place
        for layer in params["layers"]:
            x = jnp.tanh(x @ layer.T)[:, :64]
        return pool + 1, x

    def one_expert(pool, params, x):  # one [96, 64] expert of a [4, 96, 64] leaf: a read, not a layer
        x, e = x
        return pool + 1, x @ jax.lax.dynamic_index_in_dim(params["experts"], e, keepdims=False).T

    def transposed(pool, params, x):  # the whole leaf in another layout
        return pool + 1, jnp.transpose(params["w"], (0, 2, 1))

    def lookup(pool, params, x):  # more embedding rows than the table has: a lookup, not a copy
        return pool + 1, params["embed"][x]

    assert _copies(stacked, pool, {"layer_groups": [{"w": w}]}, x) > 0
    assert _copies(listed, pool, {"layers": list(w)}, x) == 0
    assert _copies(one_expert, pool, {"experts": w}, (x, jnp.int32(1))) == 0
    assert _copies(transposed, pool, {"w": w}, x) == 1
    assert _copies(lookup, pool, {"embed": w[0]}, jnp.arange(200, dtype=jnp.int32) % 96) == 0
