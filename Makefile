# metrale-jax: every target does its own set-up (idempotent), so a fresh clone needs only
# `make demo` or `make test`.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The interpreter that builds the venv: Python >= 3.12 (jax >= 0.11 needs it). .python-version
# makes pyenv's python3 a 3.12 here; the first of python3.13, python3.12, python3 that is >= 3.12 builds it.
PYTHON ?= $(shell for p in python3.13 python3.12 python3; do command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { echo $$p; break; }; done)

.PHONY: demo test test-fast lint mutants bench fixtures notebooks train-small clean

$(STAMP): pyproject.toml setup.py constraints.txt
	@test -n "$(PYTHON)" || { echo "error: no Python >= 3.12 found (install one or set PYTHON=...)"; exit 2; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/metrale-jax diff --checkpoint tiny --steps 8 --verify-batch 4 --verify-batch-ks 4,3,2 --mtp --fragment-slots --speculative --num-drafts 3 --out out/demo_diff.json
	$(VENV)/bin/metrale-jax diff --checkpoint tiny --steps 4 --verify-batch 4 --verify-batch-ks 4,2 --mtp --fragment-slots --speculative --num-drafts 3 --batch-invariant --out out/demo_diff_invariant.json

# The style gate: formatting, lint (line length 120, pyproject [tool.ruff]) and types ([tool.mypy]).
lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The full suite after the style gate: each test module in a process of its own, two at a time
# (scripts/run_tests.py says why), then the 20 slowest tests. PYTEST_ARGS goes to every pytest.
test: lint
	$(PY) scripts/run_tests.py $(PYTEST_ARGS)

# The inner loop: every layer's cheap tests, without the ones tests/tiers.py marks `slow`.
test-fast: $(STAMP)
	$(PY) scripts/run_tests.py -m "not slow" $(PYTEST_ARGS)

# The diff's mutation score alone: every shared-code state bug planted one at a time must FAIL the
# oracle variant where it first shows, each coverage mutant the diff mode that fits (part of `make test` too).
mutants: $(STAMP)
	$(PY) -m pytest tests/test_mutants.py tests/test_mutants_coverage.py

bench: $(STAMP)
	$(PY) -m benchmarks all --notes benchmarks/RESULTS.md

notebooks: $(STAMP)
	cd notebooks && for nb in *.py; do MPLBACKEND=Agg ../$(PY) $$nb || exit 1; done

train-small: $(STAMP)
	nice -n 10 $(PY) scripts/train_small.py

fixtures:
	bash scripts/make_hf_fixtures.sh

clean:
	rm -rf $(VENV) out
