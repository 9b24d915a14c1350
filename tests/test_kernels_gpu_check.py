"""`benchmarks/gpu_check.py` without a GPU: the dry run passes end to end, the real shape set is
supported on "gpu" and lowers to Triton for CUDA, and a real run refuses to start off GPU; the session
script (`benchmarks/gpu_session.sh`) stops a stage at its limit and runs the next."""

import functools
import importlib.util
import os
import subprocess
import sys

import pytest
from test_kernels_lowering import TRITON, export_cuda

from kernels_pallas.gdn import api as gdn_api
from kernels_pallas.paged_attention import api as attn_api

_path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu_check.py")
_spec = importlib.util.spec_from_file_location("gpu_check", _path)
assert _spec is not None and _spec.loader is not None
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def test_dry_run_passes(capsys):
    assert gpu_check.main(["--dry-run", "--iters", "1"]) == 0
    table = capsys.readouterr().out.strip().splitlines()
    assert "DRY RUN" in table[0]
    assert [line.split()[-1] for line in table[-len(gpu_check.CASES) :]] == ["ok"] * len(gpu_check.CASES)


@pytest.mark.parametrize("case", gpu_check.CASES, ids=lambda c: c.name)
def test_real_shapes_supported_and_lower(case):
    assert gpu_check.supported(case, case.real, "gpu") is None
    fn = {
        "gdn_rows": gdn_api.recurrent_gated_delta_rule,
        "gdn_chunk": gdn_api.chunk_gated_delta_rule,
        "attention": functools.partial(attn_api.paged_attention, scale=0.0625),
    }[case.kernel]
    assert TRITON in export_cuda(functools.partial(fn, interpret=False), *gpu_check.abstract_args(case, case.real))


def test_real_run_needs_a_gpu():
    with pytest.raises(SystemExit):
        gpu_check.main([])


def test_session_stops_each_stage_at_its_limit_and_runs_the_next(tmp_path):
    """Every stage's limit 1 s (none can import jax in that): each is stopped (exit 124), the next still runs,
    each leaves its log, the summary names all three, and the session exits 1; a stray argument exits 2."""
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu_session.sh")
    limits = {"GPU_CHECK_S": "1", "ROOFLINE_S": "1", "E2E_S": "1"}
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, **limits)
    r = subprocess.run(["bash", script, "--dry-run"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in summary] == ["gpu_session", "gpu_check", "roofline", "e2e"]
    assert all("exit 124" in line for line in summary[1:])
    assert all((tmp_path / f"{stage}.log").exists() for stage in ("gpu_check", "roofline", "e2e"))
    bad = subprocess.run(["bash", script, "--bogus"], env=env, capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "usage" in bad.stderr
