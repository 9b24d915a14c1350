# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # How many drafts at which batch width?
#
# Each verify spends K = drafts + 1 rows per sequence and emits accepted + 1 tokens. Two
# proxies, both measured on the `small` preset over held-out stdlib code:
#
# * **tokens per verify row** — what a row of verify compute buys; it matters when the verify is
#   compute-bound (wide batches);
# * **tokens per verify step** (mean accepted length) — how many tokens a sequence gains per
#   step; it matters when a step costs about the same whatever its rows (narrow batches).
#
# The engine's default K ladder (`4:3,8:3,16:1,32:1`) drafts 3 up to 8 active sequences and 1
# beyond; a flat schedule drafts `num_drafts` at every width. Greedy acceptance does not depend on
# the width, so the two schedules differ exactly where the ladder steps down.
#
# Which proxy matters depends on what a step costs, so a third panel row puts them to the test:
# the **measured** wall-clock speed-up of speculative over plain greedy generation at each width
# (steady state, `metrale_jax.engine.throughput`'s: the tokens of the decode loop after the
# prefills over its seconds, every program compiled by an untimed run first; the fused step, one
# program per scheduler step; greedy on a plain serve, speculative on a serve of that many
# drafts; runs alternated, medians), next to a stated *model* (dashed, not a measurement): a
# verify step costs one memory-bound pass until its rows exceed `R_SAT`, then grows linearly (a
# roofline). The machine it ran on is named on the figure: a CPU step is compute-bound much
# earlier than a GPU's.

# %%
import os
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from metrale_jax import research

FAST = os.environ.get("METRALE_NOTEBOOK_FAST", "0") == "1"
OUT = Path(os.environ.get("METRALE_NOTEBOOK_OUT", "figures"))
OUT.mkdir(parents=True, exist_ok=True)
WIDTHS: tuple[int, ...]
DRAFTS: tuple[int, ...]
if FAST:
    N_PROMPTS, PROMPT_LEN, NEW_TOKENS, WIDTHS, DRAFTS, REPEATS = 8, 64, 12, (1, 8), (1, 3), 2
else:
    N_PROMPTS, PROMPT_LEN, NEW_TOKENS, WIDTHS, DRAFTS, REPEATS = 32, 64, 48, (1, 2, 4, 8, 16, 32), (1, 2, 3, 4), 5

R_SAT = 32  # modelled: rows one verify pass absorbs before it turns compute-bound (an assumption)

# Any checkpoint with an MTP head (a preset, a directory, a hub id in the local HF cache); its own
# tokenizer encodes the held-out prompts.
study = research.study_for(os.environ.get("METRALE_NOTEBOOK_CHECKPOINT", "small"))
prompts = research.heldout_prompts(N_PROMPTS, PROMPT_LEN, seed=1, tokenizer=study.tokenizer)

# %%
schedules = {}
for nd in DRAFTS:
    schedules[f"flat {nd}"] = research.flat_schedule(nd)
    schedules[f"ladder {nd}"] = research.ladder_schedule(nd)
rows = study.sweep(prompts, NEW_TOKENS, schedules, WIDTHS)


def modelled_speedup(row):
    """Tokens per unit of modelled verify cost, over plain decoding's min(width, R_SAT)."""
    steps = row["run"].per_step()
    cost = np.maximum(1.0, steps["verify_rows"] / R_SAT)
    return steps["emitted"].sum() / cost.sum() / min(row["width"], R_SAT)


# %% [markdown]
# ## Measured: wall-clock speed-up over plain greedy generation

# %%
MACHINE = research.machine_label()
timings = study.throughput(prompts, NEW_TOKENS, schedules, WIDTHS, repeats=REPEATS)
measured = {(t.label, t.width): t for t in timings}
print(MACHINE)
print(
    f"{'schedule':>10} {'width':>5} {'drafts/verify':>13} {'tokens/step':>11} {'tokens/row':>10} "
    f"{'greedy tok/s':>12} {'spec tok/s':>10} {'measured':>8} {'modelled':>8}"
)
for r in rows:
    t = measured[r["label"], r["width"]]
    print(
        f"{r['label']:>10} {r['width']:>5} {r['mean_drafted']:>13.2f} {r['mean_accepted_length']:>11.3f} "
        f"{r['tokens_per_verify_row']:>10.3f} {t.plain_tokens_per_second:>12.0f} "
        f"{t.speculative_tokens_per_second:>10.0f} {t.speedup:>8.3f} {modelled_speedup(r):>8.3f}"
    )

# %%
fig, axes = plt.subplots(3, 2, figsize=(10, 10.5), sharex=True)
panels = (("tokens_per_verify_row", "tokens per verify row"), ("mean_accepted_length", "tokens per verify step"))
for col, kind in enumerate(("flat", "ladder")):
    for w in WIDTHS:
        mine = [r for r in rows if r["label"].startswith(kind) and r["width"] == w]
        xs = [r["num_drafts"] for r in mine]
        for ax, (metric, _) in zip(axes[:2, col], panels):
            ax.plot(xs, [r[metric] for r in mine], "o-", label=f"width {w}")
        line = axes[2, col].plot(xs, [measured[r["label"], w].speedup for r in mine], "o-", label=f"width {w}")
        axes[2, col].plot(xs, [modelled_speedup(r) for r in mine], "--", color=line[0].get_color(), alpha=0.6)
    axes[0, col].set_title("flat schedule" if kind == "flat" else "default K ladder (4:3,8:3,16:1,32:1)")
    for ax, (_metric, ylabel) in zip(axes[:2, col], panels):
        ax.set_ylabel(ylabel)
    axes[2, col].axhline(1.0, color="grey", lw=0.8)
    axes[2, col].set_ylabel(f"speed-up over greedy\nmeasured (solid), modelled R_SAT={R_SAT} (dashed)")
    axes[-1, col].set(xlabel="num_drafts", xticks=list(DRAFTS))
axes[0, 0].legend(fontsize=8)
fig.suptitle(
    f"measured on {MACHINE}\nfused step, steady state, median of {REPEATS} alternated runs, {NEW_TOKENS} new tokens",
    fontsize=8,
)
fig.tight_layout()
fig.savefig(OUT / "throughput_vs_drafts.png", dpi=120)

# %% [markdown]
# Reading the plot: more drafts raise tokens per step (fewer, longer steps) and lower tokens per
# row (rejected drafts are wasted rows); both are the same at every width under a flat schedule,
# because greedy acceptance does not see the batch. Under the roofline model, narrow batches gain
# from every extra draft while wide ones pay for rejected rows: the ladder keeps narrow batches on
# the step-saving side and moves wide batches, where rows are what a step costs, to one draft. The
# measured row says which regime this machine is in: where the solid line sits under the dashed
# one, a verify row costs more than the model's flat pass, and where it is under 1, speculation is
# slower than plain decoding there.
