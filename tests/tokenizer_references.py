"""The folders whose `hf_reference.json` records transformers' answers for their tokenizer and chat
template (`scripts/make_tokenizer_fixtures.hf_reference`, run in the HF venv): the committed
fixture always, and the 0.8B release stand-in (`scripts/make_release_standin.sh`, the Qwen3.5
ids and specials; outside the repository) where this machine has one with its reference."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

QWEN_BPE = Path(__file__).parent / "fixtures" / "tokenizers" / "qwen_bpe"
#: The stand-in's folder: `METRALE_JAX_STANDIN`, else the script's default.
STANDIN = Path(
    os.environ.get("METRALE_JAX_STANDIN", Path.home() / ".cache" / "metrale-jax" / "standins" / "qwen3.5-0.8b")
)


def reference_folders() -> list:
    """pytest params: the fixture, and the stand-in when its `hf_reference.json` is present."""
    folders = [pytest.param(QWEN_BPE, id="fixture")]
    if (STANDIN / "hf_reference.json").is_file():
        folders.append(pytest.param(STANDIN, id="standin-0.8b"))
    return folders


def reference(folder: Path) -> dict:
    """transformers' recorded answers for `folder`."""
    return json.loads((folder / "hf_reference.json").read_text())
