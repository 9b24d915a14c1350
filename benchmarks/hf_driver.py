"""The Hugging Face side of `benchmarks.vs_hf`: a small driver run by the HF venv's Python 3.11
(torch CPU + transformers 5.x), answering one JSON request per line on stdin with one JSON line
on stdout. It imports neither jax nor metrale_jax (they are not in that venv).

Requests (each answer carries "ok"; a failure answers {"ok": false, "error": ...}):
- {"op": "load", "dir": D, "threads": N, "impl": "default"|"eager"}: `from_pretrained(D)` in
  float32 (Qwen3-Next flat or Qwen3.5 wrapper config), parameters copied into fresh storage (the
  safetensors views are only 8-byte aligned, which sends torch's GEMV down another path).
- {"op": "context", "name": S, "tokens": [[...] * n]}: prefill n equal-length prompts as one
  batch (`use_cache=True`) and keep the cache under S.
- {"op": "prefill", "tokens": [...], "logits": bool, "repeat": R}: timed prefills from an empty
  cache, `logits_to_keep=1` (the engine also computes only the last row's logits).
- {"op": "step", "context": S, "tokens": [[...] * n], "logits": bool, "repeat": R}: timed
  forwards of the K given tokens per sequence, each over a fresh deep copy of context S's cache
  (copied untimed): K=1 is a decode step, K>1 the verify step's equivalent (every row's logits).
  With "repeat" (default 1) the forward runs R times back to back: "seconds_each" lists them
  ("seconds" is the first), the logits are the first run's.
- {"op": "quit"}.
Timings are `time.perf_counter` seconds around the forward (outputs are host tensors already).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

# `python -m benchmarks hf --threads 1` (or `all`) gives this side its own core (the engine keeps another):
# `metrale_jax.runtime_env.pin_to_one_core` publishes it in this variable (this venv cannot import
# metrale_jax, so the name is spelled here too).
if os.environ.get("METRALE_BENCH_HF_CPU") and hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {int(os.environ["METRALE_BENCH_HF_CPU"])})

# The protocol owns the real stdout; anything a library prints goes to stderr.
_PROTO = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
sys.stdout = sys.stderr

import torch  # noqa: E402
import transformers  # noqa: E402

STATE: dict = {"model": None, "contexts": {}}


def _model_classes(model_type: str):
    if model_type == "qwen3_5":
        return transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM
    if model_type == "qwen3_5_moe":
        return transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM
    return transformers.AutoConfig, transformers.AutoModelForCausalLM


def op_load(req):
    torch.set_num_threads(int(req.get("threads") or torch.get_num_threads()))
    with open(os.path.join(req["dir"], "config.json")) as f:
        model_type = json.load(f)["model_type"]
    cfg_cls, model_cls = _model_classes(model_type)
    kw = {"dtype": getattr(torch, req.get("dtype", "float32"))}
    if req.get("impl") == "eager":
        kw.update(attn_implementation="eager", experts_implementation="eager")
    cfg = cfg_cls.from_pretrained(req["dir"])
    model = model_cls.from_pretrained(req["dir"], config=cfg, **kw).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    STATE["model"] = model
    STATE["contexts"].clear()
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "model_class": type(model).__name__,
        "attn_implementation": model.config._attn_implementation,
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "threads": torch.get_num_threads(),
    }


def _ids(tokens):
    return torch.tensor(tokens, dtype=torch.long)


@torch.inference_mode()
def op_context(req):
    ids = _ids(req["tokens"])
    t0 = time.perf_counter()
    out = STATE["model"](input_ids=ids, use_cache=True, logits_to_keep=1)
    STATE["contexts"][req["name"]] = out.cache
    return {"seconds": time.perf_counter() - t0}


def _timed_runs(req, forward):
    """`forward()` R = req["repeat"] times back to back; (first output, seconds of each run)."""
    out, each = None, []
    for _ in range(int(req.get("repeat", 1))):
        t0 = time.perf_counter()
        o = forward()
        each.append(time.perf_counter() - t0)
        out = o if out is None else out
    return out, {"seconds": each[0], "seconds_each": each}


@torch.inference_mode()
def op_prefill(req):
    ids = _ids([req["tokens"]])
    out, ans = _timed_runs(req, lambda: STATE["model"](input_ids=ids, use_cache=True, logits_to_keep=1))
    if req.get("logits"):
        ans["logits"] = out.logits[0, -1].float().tolist()
    return ans


@torch.inference_mode()
def op_step(req):
    ids = _ids(req["tokens"])
    context = STATE["contexts"][req["context"]]
    caches = iter([copy.deepcopy(context) for _ in range(int(req.get("repeat", 1)))])  # copied before the timed runs
    out, ans = _timed_runs(req, lambda: STATE["model"](input_ids=ids, cache=next(caches), use_cache=True))
    if req.get("logits"):
        ans["logits"] = out.logits.float().reshape(-1, out.logits.shape[-1]).tolist()
    return ans


OPS = {"load": op_load, "context": op_context, "prefill": op_prefill, "step": op_step}


def main() -> int:
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req.get("op") == "quit":
            break
        try:
            ans = {"ok": True, **OPS[req["op"]](req)}
        except Exception as e:  # report, keep serving
            traceback.print_exc()
            ans = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        _PROTO.write(json.dumps(ans) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
