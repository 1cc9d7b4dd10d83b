#!/usr/bin/env bash
# The test command: set up .venv, then run the whole suite (extra args go to pytest).
# Two pytest-xdist workers by default (CI has 2 cores; the suite is ~13-19 CPU-minutes with its child processes,
# TESTING.md), dealt longest first (tests/conftest.py); VGRAPH_TEST_WORKERS=0 runs it in one process.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/tools/setup_env.sh"
cd "$ROOT"
# These machines set PYTHONDONTWRITEBYTECODE: every Python process the suite starts (hundreds: CLI commands,
# launchers, forkservers, benchmarks) would compile the checkout's modules again, 0.1-0.3 CPU-s each for a
# launcher or worker.  Compiled once here (seconds), they are read from __pycache__ (git ignores it).  A file
# that does not compile is the tests' to report, not this line's.
"$VENV/bin/python" -m compileall -q -j 0 vgraph backends passes tools benchmarks tests >/dev/null || true
exec "$VENV/bin/python" -m pytest -q -n "${VGRAPH_TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder --durations=15 "$@"  # the slowest, to keep CI under 6 min
