"""The suite's runner (scripts/run_tests.py) on a folder of throw-away modules: each module runs in
its own process, a failure or a signal fails the run and prints the module's output, a module with
no selected test passes, the counts and the slowest tests come from the modules' JUnit XML."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def runner(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("run_tests", ROOT / "scripts" / "run_tests.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "run_tests", mod)  # its dataclass resolves annotations there
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "TESTS", tmp_path)
    return mod


def _write(folder: Path, name: str, body: str) -> None:
    (folder / name).write_text("import os\nimport time\n\n" + body)


def test_every_module_runs_once_in_its_own_process(runner, tmp_path, capsys, monkeypatch):
    _write(tmp_path, "test_a.py", "def test_pid():\n    open(os.environ['PIDS'], 'a').write(f'{os.getpid()}\\n')\n")
    _write(tmp_path, "test_b.py", "def test_pid():\n    open(os.environ['PIDS'], 'a').write(f'{os.getpid()}\\n')\n")
    _write(tmp_path, "test_c.py", "def test_slow():\n    time.sleep(0.3)\n\ndef test_quick():\n    pass\n")
    pids = tmp_path / "pids"
    monkeypatch.setenv("PIDS", str(pids))
    assert runner.main(["--jobs", "2", "--slowest", "1"]) == 0
    assert len(set(pids.read_text().split())) == 2
    out = capsys.readouterr().out
    assert "3 modules" in out and "4 passed, 0 failed" in out
    assert "test_c.py::test_slow" in out.split("slowest 1 tests")[1]


def test_a_failure_or_a_signal_fails_the_run_and_prints_the_module(runner, tmp_path, capsys):
    _write(tmp_path, "test_ok.py", "def test_ok():\n    pass\n")
    _write(tmp_path, "test_fails.py", "def test_fails():\n    assert 1 == 2, 'PLANTED'\n")
    _write(tmp_path, "test_aborts.py", "def test_aborts():\n    os.abort()\n")
    assert runner.main(["--jobs", "1", "--slowest", "0"]) == 1
    out = capsys.readouterr().out
    assert "killed by SIGABRT" in out and "PLANTED" in out
    assert "FAILED modules: " in out and "test_fails.py" in out and "test_aborts.py" in out
    assert "ok   test_ok.py" in out


def test_a_module_with_no_selected_test_passes(runner, tmp_path, capsys):
    _write(tmp_path, "test_only.py", "def test_one():\n    pass\n")
    assert runner.main(["--slowest", "0", "-k", "nothing_matches"]) == 0
    assert "0 passed, 0 failed" in capsys.readouterr().out


def test_paths_narrow_the_modules_and_are_not_passed_to_pytest(runner, tmp_path, capsys):
    _write(tmp_path, "test_one.py", "def test_one():\n    pass\n")
    _write(tmp_path, "test_two.py", "def test_two():\n    pass\n")
    assert runner.main(["--slowest", "0", str(tmp_path / "test_two.py")]) == 0
    out = capsys.readouterr().out
    assert "1 modules" in out and "1 passed" in out and "test_one.py" not in out
