"""The research notebooks (`notebooks/*.py`, jupytext percent sources paired with .ipynb) run top
to bottom in fast mode and write their figures. They run in this process (`runpy`), so they share
`research.study_for("small")`'s compiled engine with the other research tests."""

import os
import runpy
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
FIGURES = {
    "acceptance_by_position.py": ["acceptance_by_position.png", "acceptance_vs_temperature.png"],
    "throughput_vs_drafts.py": ["throughput_vs_drafts.png"],
    "confidence_calibration.py": ["confidence_calibration.png", "confidence_cutoff.png"],
}


def test_every_notebook_is_listed():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.py")) == sorted(FIGURES)


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_notebook_is_a_paired_percent_notebook(name):
    jupytext = pytest.importorskip("jupytext")
    nb = jupytext.read(NOTEBOOKS / name)
    assert nb.metadata["jupytext"]["formats"] == "ipynb,py:percent"
    kinds = {c.cell_type for c in nb.cells}
    assert kinds == {"markdown", "code"}


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_notebook_runs_in_fast_mode_and_writes_figures(name, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib").use("Agg")
    monkeypatch.setenv("METRALE_NOTEBOOK_FAST", os.environ.get("METRALE_NOTEBOOK_FAST", "1"))
    monkeypatch.setenv("METRALE_NOTEBOOK_OUT", str(tmp_path))
    import matplotlib.pyplot as plt

    try:
        runpy.run_path(str(NOTEBOOKS / name), run_name="__main__")
    finally:
        plt.close("all")
    for fig in FIGURES[name]:
        png = tmp_path / fig
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", fig
