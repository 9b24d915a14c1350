#!/usr/bin/env python3
"""Write a stand-in of Qwen/Qwen3.5-0.8B in its released layout, with random (HF-initialised) weights.

Run it through ``scripts/make_release_standin.sh`` (the HF fixture venv: Python 3.11, torch CPU,
transformers 5.x); it never touches the network.

The folder (default ``~/.cache/metrale-jax/standins/qwen3.5-0.8b``, outside the repository: about
1.7 GB) holds what a user's download holds:

* ``config.json``            the multimodal wrapper (``Qwen3_5ForConditionalGeneration``) at the real
                             text and vision config (``REAL_TEXT`` / ``REAL_VISION``, from
                             ``shared/reference/released_checkpoints.md``), ``dtype`` bfloat16;
* ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``: bf16 shards in the
                             released names (``model.language_model.*``, ``model.visual.*``, ``mtp.*``;
                             no ``lm_head.weight``: tied);
* ``generation_config.json`` the released EOS ids (end of turn, end of text);
* ``tokenizer.json`` + ``tokenizer_config.json``: a Qwen2-style byte-level BPE (a small trained
                             vocabulary padded with unreachable entries) with Qwen's added tokens at
                             the released ids (``<|endoftext|>`` 248044, ``<|im_end|>`` 248046, ...)
                             and the fixtures' ChatML template (``scripts/make_tokenizer_fixtures.py``);
* ``hf_reference.json``      AutoTokenizer's ids for 1,200 strings and ``apply_chat_template``'s text and
                             ids (which ``tests/test_tokenizers.py`` and ``tests/test_chat_template.py``
                             check the engine's tokenizer and template against, where the folder exists).

Invariants: the weights are transformers' own initialisation of that config (seeded: the same
folder on every run), drawn in bf16; the ``mtp.*`` tensors (which ``save_pretrained`` never writes)
follow the same rules (linear N(0, initializer_range), zero-centred norms 0); the config is read
back by transformers (``AutoConfig``) and the tensor names checked against the model's before
anything is written, and the folder is replaced only when complete (written beside it, renamed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from make_tokenizer_fixtures import build_bpe, training_corpus, write_hf_reference, write_tokenizer  # noqa: E402  (this folder)
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoConfig, Qwen3_5Config, Qwen3_5ForConditionalGeneration  # noqa: E402

DEFAULT_OUT = Path.home() / ".cache" / "metrale-jax" / "standins" / "qwen3.5-0.8b"
SEED = 0
SHARD_BYTES = 1 << 30  # shards of at most 1 GiB: the 0.8B in bf16 makes two, as a sharded release does
EOS_END_OF_TURN, EOS_END_OF_TEXT = 248046, 248044
FIRST_ADDED_ID = EOS_END_OF_TEXT  # `<|endoftext|>` is the first added token

REAL_TEXT: dict[str, Any] = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_output_gate": True,
    "bos_token_id": EOS_END_OF_TEXT,
    "dtype": "bfloat16",
    "eos_token_id": EOS_END_OF_TEXT,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3584,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 6,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_value_head_dim": 128,
    "mamba_ssm_dtype": "float32",
    "max_position_embeddings": 262144,
    "model_type": "qwen3_5_text",
    "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False,
    "num_attention_heads": 8,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "rope_type": "default",
    },
    "tie_word_embeddings": True,
    "use_cache": True,
    "vocab_size": 248320,
}
REAL_VISION: dict[str, Any] = {
    "depth": 12,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 768,
    "in_channels": 3,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "model_type": "qwen3_5",
    "num_heads": 12,
    "num_position_embeddings": 2304,
    "out_hidden_size": 1024,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
GENERATION_CONFIG = {
    "bos_token_id": EOS_END_OF_TEXT,
    "do_sample": True,
    "eos_token_id": [EOS_END_OF_TURN, EOS_END_OF_TEXT],
    "pad_token_id": EOS_END_OF_TEXT,
    # NOTE: the recommended sampling of the Qwen3 family's releases (inferred, not read from the 0.8B).
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
}


def config_json() -> dict:
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "image_token_id": 248056,
        "model_type": "qwen3_5",
        "text_config": REAL_TEXT,
        "tie_word_embeddings": True,
        "transformers_version": transformers.__version__,
        "video_end_token_id": 248058,
        "video_start_token_id": 248057,
        "video_token_id": 248057,
        "vision_config": REAL_VISION,
        "vision_end_token_id": 248054,
        "vision_start_token_id": 248053,
    }


def build_model(folder: Path) -> Qwen3_5ForConditionalGeneration:
    """transformers' initialisation of the config in ``folder``, drawn in bf16 (seeded)."""
    cfg = AutoConfig.from_pretrained(folder)
    assert isinstance(cfg, Qwen3_5Config), type(cfg)
    tc = cfg.text_config
    assert tc.layer_types == REAL_TEXT["layer_types"] and tc.vocab_size == REAL_TEXT["vocab_size"]
    assert cfg.vision_config.out_hidden_size == tc.hidden_size
    torch.manual_seed(SEED)
    model = Qwen3_5ForConditionalGeneration._from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight, "not tied"
    return model


def mtp_tensors(trunk: dict[str, torch.Tensor], std: float) -> dict[str, torch.Tensor]:
    """mtp.*: fc [H, 2H], the two pre-fc norms, one full-attention decoder layer (a copy of the
    trunk's last full-attention layer's shapes), the final norm; HF's rules: linear N(0, std),
    zero-centred RMSNorms 0."""
    hidden = REAL_TEXT["hidden_size"]
    last_full = max(i for i, t in enumerate(REAL_TEXT["layer_types"]) if t == "full_attention")
    prefix = f"model.language_model.layers.{last_full}."
    shapes = {
        "mtp.fc.weight": (hidden, 2 * hidden),
        "mtp.pre_fc_norm_embedding.weight": (hidden,),
        "mtp.pre_fc_norm_hidden.weight": (hidden,),
        "mtp.norm.weight": (hidden,),
    }
    shapes.update(
        {"mtp.layers.0." + n[len(prefix) :]: tuple(t.shape) for n, t in trunk.items() if n.startswith(prefix)}
    )
    gen = torch.Generator().manual_seed(SEED + 1)
    out = {}
    for name, shape in sorted(shapes.items()):
        if len(shape) == 1:
            out[name] = torch.zeros(shape, dtype=torch.bfloat16)
        else:
            out[name] = torch.normal(0.0, std, shape, generator=gen).to(torch.bfloat16)
    return out


def released_tensors(model) -> dict[str, torch.Tensor]:
    """The state dict in the released names: the tied head dropped, every name under
    model.language_model. / model.visual."""
    sd = {n: t.detach().contiguous() for n, t in model.state_dict().items() if n != "lm_head.weight"}
    bad = [n for n in sd if not n.startswith(("model.language_model.", "model.visual."))]
    assert not bad, f"unexpected tensor names: {bad[:5]}"
    return sd


def write_shards(tensors: dict[str, torch.Tensor], folder: Path) -> int:
    """bf16 shards of at most SHARD_BYTES, in name order, and their index; returns the total bytes."""
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        n = tensors[name].numel() * tensors[name].element_size()
        if groups[-1] and size + n > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    weight_map, total = {}, 0
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(folder / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
        total += sum(tensors[n].numel() * tensors[n].element_size() for n in names)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def released_tokenizer():
    """The stand-in's tokenizer: an 800-entry byte-level BPE over the fixtures' corpus, its added
    tokens from the released first id, so every special token has the released model's id."""
    import numpy as np
    from tokenizers import pre_tokenizers

    corpus = training_corpus(np.random.default_rng(0), None)
    tok = build_bpe(corpus, 800, pre_tokenizers.ByteLevel.alphabet(), first_added_id=FIRST_ADDED_ID)
    assert tok.token_to_id("<|im_end|>") in GENERATION_CONFIG["eos_token_id"]
    return tok


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the folder to write (default {DEFAULT_OUT})")
    args = ap.parse_args(argv)
    t0 = time.time()
    out: Path = args.out.expanduser().resolve()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_json(tmp / "config.json", config_json())
    model = build_model(tmp)
    tensors = released_tensors(model)
    tensors.update(mtp_tensors(tensors, REAL_TEXT["initializer_range"]))
    del model
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    total = write_shards(tensors, tmp)
    write_tokenizer(tmp, released_tokenizer())
    write_hf_reference(tmp)
    write_json(tmp / "generation_config.json", {**GENERATION_CONFIG, "transformers_version": transformers.__version__})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    n_text = sum(t.numel() for n, t in tensors.items() if n.startswith("model.language_model."))
    n_vis = sum(t.numel() for n, t in tensors.items() if n.startswith("model.visual."))
    n_mtp = sum(t.numel() for n, t in tensors.items() if n.startswith("mtp."))
    print(
        f"wrote {out}: {len(tensors)} tensors, {total / 2**30:.2f} GiB bf16 "
        f"(text {n_text / 1e6:.1f}M, vision {n_vis / 1e6:.1f}M, mtp {n_mtp / 1e6:.1f}M params) "
        f"in {time.time() - t0:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
