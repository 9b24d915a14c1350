"""Token selection: greedy, plain sampling and the two speculative acceptance rules, per row.

Owns: a request's sampling parameters (`Sampling`, host, validated), their traced form in a
program (`SamplingRows`, a `HostInput` of [B] int32 leaves, floats as their bits), the draw keys
(`draw_key`), the allowed set (`allowed`), the draw itself (`draw`: the token at a position), the
processed distribution (`probabilities`), rejection sampling's acceptance (`rejection_verdict`),
its drafter's draw (`draft_draw`) and a verify's rows under it (`rejection_rows`).

Invariants:
- Every function is per row: no value of one row reads another row, so a sequence's draws do not
  depend on its batch, slot or width.
- A draw's randomness comes only from (seed, absolute position of the drawn token, tag):
  `fold_in(fold_in(key(seed), position), tag)`; not from a slot, a step, a batch or a process.
- Temperature 0 is greedy: the draw is `first_argmax(logits)`, the very token a greedy program
  selects (the sampled branch is computed and discarded).
- The mask order is HF `generate`'s (`_get_logits_processor`): temperature, then top-k, then
  top-p, then min-p, each applied to what the previous one left. Ties at a top-k or top-p cut-off
  are kept (HF's top-k keeps them; its top-p breaks them by its sort's order).
- The draw is the Gumbel-max form: argmax over the allowed set of logits / T + g, with g the
  Gumbel noise of (seed, position, `TAG_DRAW`). A drafter that draws with its own logits and the
  same (seed, position) is coupled to the target (drafter-invariant speculative decoding, Daliri,
  Musco and Suresh 2024): accepting drafts while they equal the target's draw emits exactly the
  tokens plain sampling emits.
- Rejection sampling (`--speculative-sampling rejection`) draws each draft from the drafter's law
  q with the drafter's own keys (`TAG_DRAFT`), and the verify accepts, resamples and adds the
  bonus with keys of their own (`TAG_ACCEPT`, `TAG_RESIDUAL`): the emitted tokens follow the
  target's law (not plain sampling's tokens). At temperature 0 every law is the one-hot of the
  first argmax, so the rule emits greedy decoding's tokens.
"""

from __future__ import annotations

import dataclasses
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.reductions import fenced, first_argmax, pairwise_sum
from metrale_jax.engine.capacity import PoolCounts
from metrale_jax.engine.inputs import Array, HostInput
from metrale_jax.engine.settings import SPECULATIVE_SAMPLING_MODES
from metrale_jax.model.invariant import products_invariant

#: The key tags: the coupled draw (target, and the Gumbel drafter), rejection sampling's uniform,
#: its residual draw and its drafter's own draw.
TAG_DRAW, TAG_ACCEPT, TAG_RESIDUAL, TAG_DRAFT = 0, 1, 2, 3

#: The speculative acceptance rules (the serve setting `--speculative-sampling`).
SPECULATIVE_MODES = SPECULATIVE_SAMPLING_MODES


@dataclasses.dataclass(frozen=True)
class Sampling:
    """One request's sampling parameters (host). temperature 0: greedy; top_k 0, top_p 1.0 and
    min_p 0.0: that filter off; seed: the request's key (any integer; its value mod 2**32 keys the draws)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    def __post_init__(self):
        problems = sampling_problems(self.temperature, self.top_k, self.top_p, self.min_p, self.seed)
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def describe(self) -> str:
        """The parameters as a report states them ("T 0.7, top-p 0.9, seed 7"; filters that are off left out)."""
        parts = [f"T {self.temperature:g}"]
        parts += [f"top-k {self.top_k}"] if self.top_k else []
        parts += [f"top-p {self.top_p:g}"] if self.top_p < 1.0 else []
        parts += [f"min-p {self.min_p:g}"] if self.min_p else []
        return ", ".join([*parts, f"seed {self.seed}"])


def per_sequence(sampling: Sampling | None, n: int) -> list[Sampling] | None:
    """n sequences' parameters from one request's: sequence i draws with seed + i (None: greedy)."""
    return None if sampling is None else [dataclasses.replace(sampling, seed=sampling.seed + i) for i in range(n)]


def sampling_problems(temperature, top_k, top_p, min_p, seed) -> list[str]:
    """Why these parameters are refused (empty: accepted): a temperature that is negative or not
    finite, top_k < 0 or not an integer, top_p outside (0, 1], min_p outside [0, 1], a seed that
    is not an integer."""
    out = []
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature):
        out.append(f"temperature {temperature!r} is not a finite number")
    elif temperature < 0:
        out.append(f"temperature {temperature} is negative (0 is greedy)")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
        out.append(f"top-k {top_k!r} is not an integer >= 0 (0: off)")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        out.append(f"top-p {top_p!r} is outside (0, 1]")
    if isinstance(min_p, bool) or not isinstance(min_p, (int, float)) or not 0.0 <= min_p <= 1.0:
        out.append(f"min-p {min_p!r} is outside [0, 1]")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        out.append(f"seed {seed!r} is not an integer")
    return out


def _bits(x: float) -> np.int32:
    return np.float32(x).view(np.int32)


class SamplingRows(HostInput):
    """The sampling parameters of a program's B sequences (traced, so no value recompiles).
    NOTE: the floats travel as their float32 bits in int32 leaves: every host input moves to the
    device in one int32 vector (`programs.HostPacking`)."""

    temperature: Array  # [B] float32 bits; 0.0: greedy
    top_k: Array  # [B] 0: off
    top_p: Array  # [B] float32 bits; 1.0: off
    min_p: Array  # [B] float32 bits; 0.0: off
    seed: Array  # [B] the key's low 32 bits

    @classmethod
    def padded(cls, counts: PoolCounts, b: int) -> SamplingRows:
        """B greedy rows (the counts fix nothing here; the argument keeps every input's constructor alike)."""
        del counts
        return cls(
            temperature=np.full((b,), _bits(0.0), np.int32),
            top_k=np.zeros((b,), np.int32),
            top_p=np.full((b,), _bits(1.0), np.int32),
            min_p=np.full((b,), _bits(0.0), np.int32),
            seed=np.zeros((b,), np.int32),
        )

    def set_row(self, i: int, s: Sampling) -> None:
        """Fill row i (host numpy, in place) with `s`."""
        self.temperature[i], self.top_k[i] = _bits(s.temperature), s.top_k
        self.top_p[i], self.min_p[i] = _bits(s.top_p), _bits(s.min_p)
        self.seed[i] = np.asarray(int(s.seed) % 2**32, np.uint32).view(np.int32)

    def floats(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Inside a program: (temperature, top_p, min_p) [B] float32."""
        f = lambda x: jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.int32), jnp.float32)  # noqa: E731
        return f(self.temperature), f(self.top_p), f(self.min_p)


def draw_key(seed: jax.Array, position: jax.Array, tag: int) -> jax.Array:
    """The key of the draw at absolute `position` of a sequence with `seed` (int32 scalars)."""
    key = jax.random.key(jax.lax.bitcast_convert_type(jnp.asarray(seed, jnp.int32), jnp.uint32))
    return jax.random.fold_in(jax.random.fold_in(key, position), tag)


def allowed(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """The allowed set of one row: bool [V] of scaled logits [V] f32 (already divided by the
    temperature), in HF's order: top-k (the k largest, ties with the k-th kept; 0: off), then
    top-p over what top-k left (a token is kept iff the probability mass of the tokens sorted
    above it is < top_p; 1: off), then min-p (probability >= min_p x the largest). The row's maximum is
    always allowed."""
    v = scaled.shape[-1]
    desc = -jnp.sort(-scaled)
    kth = desc[jnp.clip(top_k - 1, 0, v - 1)]
    keep = (top_k <= 0) | (scaled >= kth)
    s = jnp.where(keep, scaled, -jnp.inf)
    desc = jnp.where(jnp.arange(v) < jnp.where(top_k > 0, top_k, v), desc, -jnp.inf)
    e = jnp.exp(desc - desc[0])
    probs = e / pairwise_sum(e)
    before = jnp.cumsum(probs) - probs  # the mass strictly above each sorted token
    n_keep = jnp.sum(before < top_p)
    keep &= (top_p >= 1.0) | (s >= desc[jnp.maximum(n_keep - 1, 0)])
    # NOTE: min-p on the ratio to the top probability, exp(s - max): softmax's normaliser cancels.
    return keep & (jnp.exp(scaled - desc[0]) >= min_p)


def _row_draw(logits, temperature, top_k, top_p, min_p, seed, position):
    t = jnp.where(temperature > 0, temperature, 1.0)
    scaled = logits / t
    mask = allowed(scaled, top_k, top_p, min_p)
    g = jax.random.gumbel(draw_key(seed, position, TAG_DRAW), logits.shape, jnp.float32)
    sampled = first_argmax(jnp.where(mask, scaled + g, -jnp.inf))
    return jnp.where(temperature > 0, sampled, first_argmax(logits))


def draw(logits: jax.Array, rows: SamplingRows, positions: jax.Array) -> jax.Array:
    """The token drawn at `positions` [R] int32 (of the drawn token) from logits [R, V] f32 of
    rows whose parameters are `rows` gathered to [R] (`take`). Returns [R] int32."""
    temperature, top_p, min_p = rows.floats()
    return jax.vmap(_row_draw)(logits, temperature, rows.top_k, top_p, min_p, rows.seed, positions)


def take(rows: SamplingRows, index: jax.Array) -> SamplingRows:
    """`rows` gathered at `index` (a row's sequence): one entry per logits row."""
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x)[index], rows)


def _row_probabilities(logits, temperature, top_k, top_p, min_p):
    t = jnp.where(temperature > 0, temperature, 1.0)
    scaled = logits / t
    s = jnp.where(allowed(scaled, top_k, top_p, min_p), scaled, -jnp.inf)
    # NOTE: under the batch-invariant mode the max is fenced from its exponentials (`reductions.fenced`, as
    # the MoE router's): fused, XLA CPU rounds them by the array's size, i.e. by the rows drawn together.
    e = jnp.exp(s - fenced(jnp.max(s), products_invariant()))
    soft = e / pairwise_sum(e)
    onehot = (jnp.arange(logits.shape[-1]) == first_argmax(logits)).astype(jnp.float32)
    return jnp.where(temperature > 0, soft, onehot)


def probabilities(logits: jax.Array, rows: SamplingRows) -> jax.Array:
    """The law each row's draw follows: softmax(logits / T) on the allowed set, a one-hot of the
    first argmax at T = 0. logits [R, V] f32, `rows` [R]; returns [R, V] f32."""
    temperature, top_p, min_p = rows.floats()
    return jax.vmap(_row_probabilities)(logits, temperature, rows.top_k, top_p, min_p)


def rejection_verdict(
    p: jax.Array, q: jax.Array, drafts: jax.Array, n_drafts: jax.Array, seed: jax.Array, position: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Rejection sampling's verdict for one sequence (Leviathan et al. 2023, Chen et al. 2023).

    p [T, V]: the target's law at the T verify rows (row t: the token at position + t); q [T - 1,
    V]: the law each draft was drawn from; drafts [T - 1] int32, of which the first n_drafts are
    real. Draft t is accepted with probability min(1, p_t(x) / q_t(x)) (uniform of (seed,
    position + t, `TAG_ACCEPT`)); at the first rejection the token is drawn from
    norm(max(0, p_t - q_t)), and after n_drafts acceptances from p_{n_drafts} (the bonus), each a
    Gumbel-max draw of (seed, position + t, `TAG_RESIDUAL`). Returns (accepted drafts, the token
    emitted after them), int32 scalars. The emitted tokens follow p's law whatever q is.
    """
    p, q = jnp.asarray(p), jnp.asarray(q)
    t_rows = p.shape[0]
    idx = jnp.arange(t_rows - 1)
    px = jnp.take_along_axis(p[:-1], drafts[:, None], axis=1)[:, 0]
    qx = jnp.take_along_axis(q, drafts[:, None], axis=1)[:, 0]
    u = jax.vmap(lambda i: jax.random.uniform(draw_key(seed, position + i, TAG_ACCEPT)))(idx)
    ok = (u * qx < px) & (idx < n_drafts)
    na = jnp.sum(jnp.cumprod(ok.astype(jnp.int32)), dtype=jnp.int32)
    q_pad = jnp.concatenate([q, jnp.zeros_like(p[:1])], axis=0)[na]
    residual = jnp.where(na < n_drafts, jnp.maximum(p[na] - q_pad, 0.0), p[na])
    g = jax.random.gumbel(draw_key(seed, position + na, TAG_RESIDUAL), residual.shape, jnp.float32)
    token = first_argmax(jnp.where(residual > 0, jnp.log(residual) + g, -jnp.inf))
    return na, token


def _row_draft(logits, temperature, top_k, top_p, min_p, seed, position):
    q = _row_probabilities(logits, temperature, top_k, top_p, min_p)
    g = jax.random.gumbel(draw_key(seed, position, TAG_DRAFT), logits.shape, jnp.float32)
    return first_argmax(jnp.where(q > 0, jnp.log(q) + g, -jnp.inf)), q


def draft_draw(logits: jax.Array, rows: SamplingRows, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rejection sampling's drafter: each row's draft drawn from its law q (`probabilities` of the
    drafter's logits [R, V] f32 with `rows` [R]) by the Gumbel-max draw of (seed, the drafted
    token's position [R], `TAG_DRAFT`), independent of the target's draws. Returns (drafts [R]
    int32, q [R, V] f32), the law the verify's `rejection_verdict` reads. At temperature 0 the
    draft is `first_argmax(logits)`."""
    temperature, top_p, min_p = rows.floats()
    return jax.vmap(_row_draft)(logits, temperature, rows.top_k, top_p, min_p, rows.seed, positions)


def rejection_rows(
    p: jax.Array, q: jax.Array, tokens: jax.Array, lens: jax.Array, seed: jax.Array, position: jax.Array
) -> jax.Array:
    """A batched verify's tokens under rejection sampling, laid out as the greedy rule reads them.

    p [B, T, V] f32: the target's law at each sequence's verify rows (row t: the token at
    position[b] + t); q [B, T - 1, V]: the laws its drafts were drawn from; tokens [B, T] int32:
    the rows [last, drafts...], lens [B] of them real; seed [B]. Returns [B, T] int32: with na the
    accepted drafts and x the token after them (`rejection_verdict`), row t < na holds draft t + 1,
    row na holds x, later rows -1. So the drafts "equal the row before them" exactly up to na
    (a rejected draft has p < q, where the residual is 0, so x never equals it): greedy
    acceptance of these rows (host or device) finds na, and the emitted tokens are rows 0..na.
    """
    chex.assert_rank([p, q, tokens], [3, 3, 2])
    t = tokens.shape[1]
    chex.assert_shape(q, (tokens.shape[0], t - 1, p.shape[2]))
    drafts = tokens[:, 1:]
    na, x = jax.vmap(rejection_verdict)(p, q, jnp.maximum(drafts, 0), lens - 1, seed, position)
    ahead = jnp.concatenate([drafts, jnp.full_like(drafts[:, :1], -1)], axis=1)
    r = jnp.arange(t, dtype=jnp.int32)[None, :]
    return jnp.where(r < na[:, None], ahead, jnp.where(r == na[:, None], x[:, None], -1)).astype(jnp.int32)
