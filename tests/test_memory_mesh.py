"""`metrale-jax memory` plans a tensor-parallel mesh from a one-device machine: the CLI gives
XLA's CPU client the mesh's devices before JAX starts (`memory.activations.provide_host_devices`),
with no XLA_FLAGS from the user."""

import json
import os
import subprocess
import sys


def test_tensor_parallel_2_plans_on_one_device_without_xla_flags(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["METRALE_JAX_ACTIVATIONS_CACHE"] = str(tmp_path)
    argv = ["memory", "--checkpoint", "tiny", "--device", "H200", "--isl", "64", "--osl", "16"]
    argv += ["--concurrency", "2", "--json", "--", "--tensor-parallel-size", "2"]
    code = "from metrale_jax_cli.main import cli; cli()"
    run = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    act = json.loads(run.stdout)["activations"]
    assert act["run"]["compiled"] > 0 and all(p["source"] == "compiled" for p in act["programs"])
