"""The plain cached forward: a batch of sequences of equal length with a contiguous KV cache.

Owns: `new_cache` and `forward` — the reference forward with caches (prefill, then decode
steps), used by `metrale-jax logits`, by the HF parity tests and as the engine's oracle.

It is the engine's own state IO with the trivial addressing: sequence b owns GDN slot b and KV
block b, one block of `max_len` tokens, so there is one implementation of every stateful op.
Invariant: `forward` over T > 1 rows uses the chunked GDN form, over T == 1 the recurrent form
(HF's dispatch); both read and write the same state.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from kernels_pallas.ops import Ops, ReferenceOps
from metrale_jax.config import ModelConfig
from metrale_jax.model.state_io import PoolIO, TrunkState
from metrale_jax.model.trunk import head, trunk


def new_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> TrunkState:
    """Zero state for `batch` sequences of up to `max_len` tokens (+1 null block for padding)."""
    nl, nf = cfg.num_linear_layers, cfg.num_full_layers
    kv = (nf, batch + 1, max_len, cfg.num_key_value_heads, cfg.head_dim)
    return TrunkState(
        gdn_h=jnp.zeros(
            (nl, batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
            jnp.float32,
        ),
        gdn_conv=jnp.zeros((nl, batch, cfg.conv_dim, cfg.linear_conv_kernel_dim), dtype),
        kv_k=jnp.zeros(kv, dtype),
        kv_v=jnp.zeros(kv, dtype),
    )


def forward(params, cfg: ModelConfig, tokens, cache: TrunkState, start, ops: Ops | None = None):
    """tokens [B, T] int32 at positions start..start+T-1 (start: int32 scalar, traced); ops: the
    forward's ops object (static), None = `ReferenceOps()`. `cache` is donated by `forward_jit`.

    Returns (logits [B, T, V] f32, hidden [B, T, Hd] pre-final-norm, new cache).
    """
    chex.assert_rank(tokens, 2)
    b, t = tokens.shape
    chex.assert_axis_dimension(cache.gdn_h, 1, b)
    io = PoolIO(
        cfg=cfg,
        slots=jnp.arange(b, dtype=jnp.int32),
        lens=jnp.full((b,), t, jnp.int32),
        positions=(start + jnp.arange(t, dtype=jnp.int32))[None, :].repeat(b, 0),
        block_tables=jnp.arange(b, dtype=jnp.int32)[:, None],
        null_block=b,
        gdn_mode="chunk" if t > 1 else "rows",
        ops=ReferenceOps() if ops is None else ops,
    )
    hidden, cache = trunk(params, cfg, tokens, io, cache)
    return head(params, cfg, hidden), hidden, cache


forward_jit = jax.jit(forward, static_argnames=("cfg", "ops"), donate_argnames=("cache",))


def prefill_and_decode(params, cfg: ModelConfig, prompt, decode_steps: int, dtype=None, feed=None):
    """Greedy (or fed) generation of one sequence on the plain cached forward.

    prompt: 1-D int tokens. feed: optional tokens to feed at each decode step instead of the
    argmax. Returns (logits [len(prompt) + decode_steps, V] f32 numpy-ready, tokens fed).
    """
    dtype = dtype or params["embed"].dtype
    prompt = jnp.asarray(prompt, jnp.int32)[None, :]
    cache = new_cache(cfg, 1, prompt.shape[1] + decode_steps + 1, dtype)
    logits, _, cache = forward_jit(params, cfg, prompt, cache, jnp.int32(0))
    out = [logits[0]]
    fed = []
    for s in range(decode_steps):
        tok = int(jnp.argmax(out[-1][-1])) if feed is None else int(feed[s])
        fed.append(tok)
        step_logits, _, cache = forward_jit(
            params, cfg, jnp.array([[tok]], jnp.int32), cache, jnp.int32(prompt.shape[1] + s)
        )
        out.append(step_logits[0])
    return jnp.concatenate(out, axis=0), fed
