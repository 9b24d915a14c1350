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
# # Does the drafter's confidence predict acceptance, and what does a cut-off save?
#
# The MTP head proposes its argmax; its probability of that token is the draft's confidence. If
# confidence is calibrated, a schedule can stop drafting at the first low-confidence draft
# (`DraftSchedule.confidence_stop`, a log-probability) and save verify rows that would have
# been rejected anyway. Measured on the `small` preset over held-out stdlib code:
#
# 1. a calibration curve: empirical acceptance of reached drafts against their confidence;
# 2. the cut-off trade-off: verify rows saved against tokens lost, replayed step by step from
#    one uncut run, and checked against real runs with the cut-off on.

# %%
import os
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from metrale_jax import research

FAST = os.environ.get("METRALE_NOTEBOOK_FAST", "0") == "1"
OUT = Path(os.environ.get("METRALE_NOTEBOOK_OUT", "figures"))
OUT.mkdir(parents=True, exist_ok=True)
N_PROMPTS, PROMPT_LEN, NEW_TOKENS, WIDTH = (8, 64, 24, 8) if FAST else (64, 64, 64, 16)
MEASURED = (0.3, 0.6) if FAST else (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
NUM_DRAFTS = 3 if FAST else 4

# Any checkpoint with an MTP head (a preset, a directory, a hub id in the local HF cache); its own
# tokenizer encodes the held-out prompts.
study = research.study_for(os.environ.get("METRALE_NOTEBOOK_CHECKPOINT", "small"))
prompts = research.heldout_prompts(N_PROMPTS, PROMPT_LEN, seed=2, tokenizer=study.tokenizer)
run = study.run(prompts, NEW_TOKENS, research.flat_schedule(NUM_DRAFTS), width=WIDTH)

# %% [markdown]
# ## Calibration

# %%
cal = run.calibration(bins=10)
cal0 = run.calibration(bins=10, position=0)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
ax1.plot([0, 1], [0, 1], ":", color="grey", label="perfect calibration")
for c, label in ((cal, "all reached drafts"), (cal0, "first drafts")):
    ok = c.count > 0
    ax1.plot(c.mean_confidence[ok], c.acceptance[ok], "o-", label=label)
ax1.set(
    xlabel="drafter confidence (probability)",
    ylabel="acceptance",
    xlim=(0, 1),
    ylim=(0, 1),
    title="Does confidence predict acceptance?",
)
ax1.legend(fontsize=8)
ax2.bar(0.5 * (cal.edges[1:] + cal.edges[:-1]), cal.count, width=0.09)
ax2.set(xlabel="drafter confidence (probability)", ylabel="reached drafts", title="Where the drafts are")
fig.suptitle(f"measured on {research.machine_label()}", fontsize=8)
fig.tight_layout()
fig.savefig(OUT / "confidence_calibration.png", dpi=120)
print("bins (mean confidence -> acceptance, count):")
for c, a, n in zip(cal.mean_confidence, cal.acceptance, cal.count):
    if n:
        print(f"  {c:.2f} -> {a:.2f}  ({n})")
n0 = cal0.count.sum()
print(
    f"first drafts: mean confidence {np.nansum(cal0.mean_confidence * cal0.count) / n0:.3f}, "
    f"acceptance {np.nansum(cal0.acceptance * cal0.count) / n0:.3f}"
)

# %% [markdown]
# ## What a confidence cut-off saves
#
# A cut-off never changes the output (the verify decides every token); it trades verify rows for
# steps. The replay applies each cut-off to the recorded steps of the uncut run; the measured
# points rerun the decoding with the cut-off on.

# %%
probs = np.linspace(0.05, 0.95, 19)
replay = run.cutoff_tradeoff(np.log(probs).tolist())
base = run.summary()
measured = []
for p in MEASURED:
    cut = study.run(
        prompts, NEW_TOKENS, research.flat_schedule(NUM_DRAFTS, confidence_stop=float(np.log(p))), width=WIDTH
    )
    assert cut.tokens == run.tokens, "a cut-off changed the output"
    s = cut.summary()
    measured.append(
        {
            "p": p,
            "rows_saved": 1 - cut.verify_rows.sum() / run.verify_rows.sum(),
            "extra_steps": s["steps"] / base["steps"] - 1,
            **s,
        }
    )

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
mp = [m["p"] for m in measured]
ax1.plot(probs, replay["rows_saved"], "-", label="verify rows saved (replay)")
ax1.plot(probs, replay["tokens_lost"], "--", label="tokens per step lost (replay)")
ax1.plot(mp, [m["rows_saved"] for m in measured], "o", label="verify rows saved (measured)")
ax1.plot(mp, [m["extra_steps"] for m in measured], "s", label="extra verify steps (measured)")
ax1.set(xlabel="cut-off (drafter probability)", ylabel="fraction", title="What a cut-off saves and costs")
ax1.legend(fontsize=7)
ax2.plot(probs, replay["tokens_per_verify_row"], "-", label="tokens per row (replay)")
ax2.plot(mp, [m["tokens_per_verify_row"] for m in measured], "o", label="tokens per row (measured)")
ax2.plot(mp, [m["mean_accepted_length"] for m in measured], "s", label="tokens per step (measured)")
ax2.axhline(base["tokens_per_verify_row"], color="grey", ls=":", label="no cut-off: tokens per row")
ax2.axhline(base["mean_accepted_length"], color="grey", ls="--", label="no cut-off: tokens per step")
ax2.set(xlabel="cut-off (drafter probability)", title="Efficiency under a cut-off")
ax2.legend(fontsize=7)
fig.suptitle(f"measured on {research.machine_label()}", fontsize=8)
fig.tight_layout()
fig.savefig(OUT / "confidence_cutoff.png", dpi=120)
print(f"{'cut-off p':>9} {'rows saved':>10} {'extra steps':>11} {'tokens/row':>10} {'tokens/step':>11}")
for m in measured:
    print(
        f"{m['p']:>9.2f} {m['rows_saved']:>10.3f} {m['extra_steps']:>11.3f} "
        f"{m['tokens_per_verify_row']:>10.3f} {m['mean_accepted_length']:>11.3f}"
    )
print(f"{'none':>9} {0:>10.3f} {0:>11.3f} {base['tokens_per_verify_row']:>10.3f} {base['mean_accepted_length']:>11.3f}")
