"""The Hugging Face venv (Python 3.11, torch 2.13.0 CPU, transformers 5.24.0) and the client of
the driver that runs in it.

Owns: `ensure_hf_venv` (find the venv, or create it by running the fixture script's own
venv logic) and `HFClient` (the `hf_driver.py` subprocess and its JSON-lines protocol).

The venv is the one `scripts/make_hf_fixtures.sh` makes, at `${HF_VENV:-/tmp/metrale-hf-venv}`;
its creation and pinned installs are not duplicated here:
when the venv is missing or incomplete we run it with `--venv-only`: it creates and fills the
venv, checks the CPU torch, and exits without writing a fixture.
Where that fails (no Python 3.11, no wheels) the comparison is skipped with the script's reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE_SCRIPT = os.path.join(ROOT, "scripts", "make_hf_fixtures.sh")
DRIVER = os.path.join(ROOT, "benchmarks", "hf_driver.py")
WANT = {"torch": "2.13.0", "transformers": "5.24.0"}
_PROBE = (
    "import sys, torch, transformers; "
    "assert sys.version_info[:2] == (3, 11), sys.version; "
    "assert torch.version.cuda is None, 'CUDA torch'; "
    "print(torch.__version__, transformers.__version__)"
)


def hf_venv_dir() -> str:
    return os.environ.get("HF_VENV", "/tmp/metrale-hf-venv")


def _probe(python: str) -> tuple[bool, str]:
    if not os.path.isfile(python):
        return False, f"{python} does not exist"
    r = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return False, (r.stderr.strip().splitlines() or ["probe failed"])[-1]
    torch_v, tf_v = r.stdout.split()
    if not torch_v.startswith(WANT["torch"]) or tf_v != WANT["transformers"]:
        return False, f"venv has torch {torch_v} / transformers {tf_v}, want {WANT}"
    return True, f"torch {torch_v}, transformers {tf_v}"


def ensure_hf_venv(create: bool = True) -> tuple[str | None, str]:
    """(the venv's python or None, a one-line reason). With create, a missing or incomplete venv
    is made by `scripts/make_hf_fixtures.sh --venv-only` (minutes; pip needs the CPU torch wheel)."""
    python = os.path.join(hf_venv_dir(), "bin", "python")
    ok, why = _probe(python)
    if ok:
        return python, why
    if not create:
        return None, f"HF venv not ready ({why}); run `bash scripts/make_hf_fixtures.sh` or drop --no-hf-setup"
    print(f"[bench] HF venv not ready ({why}); creating it with {FIXTURE_SCRIPT} --venv-only", file=sys.stderr)
    r = subprocess.run(["bash", FIXTURE_SCRIPT, "--venv-only"], capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        tail = " | ".join((r.stderr.strip() or r.stdout.strip()).splitlines()[-3:])
        return None, f"could not create the HF venv with {FIXTURE_SCRIPT} (exit {r.returncode}): {tail}"
    ok, why = _probe(python)
    return (python, why) if ok else (None, f"HF venv still not usable after creation: {why}")


class HFClient:
    """The driver subprocess. `call(op, **fields)` sends one request and returns its answer dict;
    raises RuntimeError with the driver's error (and its stderr file) when a request fails."""

    def __init__(self, python: str, stderr_path: str):
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
        env.pop("PYTHONPATH", None)
        self._err = open(stderr_path, "w")
        self.stderr_path = stderr_path
        self.proc = subprocess.Popen(
            [python, DRIVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            env=env,
            cwd=ROOT,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None  # both are pipes (above)
        self._send, self._answers = self.proc.stdin, self.proc.stdout

    def call(self, op: str, **fields) -> dict:
        self._send.write(json.dumps({"op": op, **fields}) + "\n")
        self._send.flush()
        line = self._answers.readline()
        if not line:
            raise RuntimeError(f"HF driver exited (code {self.proc.poll()}); see {self.stderr_path}")
        ans = json.loads(line)
        if not ans.get("ok"):
            raise RuntimeError(f"HF driver {op}: {ans.get('error')} (see {self.stderr_path})")
        return ans

    def close(self):
        if self.proc.poll() is None:
            try:
                self._send.write(json.dumps({"op": "quit"}) + "\n")
                self._send.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self._err.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
