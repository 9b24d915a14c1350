"""`python -m benchmarks …`: see `benchmarks.cli` (which sets the thread environment before it
loads jax)."""

import sys

from benchmarks.cli import main

sys.exit(main())
