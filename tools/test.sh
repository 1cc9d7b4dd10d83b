#!/usr/bin/env bash
# The test command: set up .venv, then run the whole suite (extra args go to pytest).
# Two pytest-xdist workers by default (CI has 2 cores; the suite is ~13-19 CPU-minutes with its child processes,
# TESTING.md), dealt longest first (tests/conftest.py); VGRAPH_TEST_WORKERS=0 runs it in one process.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/tools/setup_env.sh"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest -q -n "${VGRAPH_TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder --durations=15 "$@"  # the slowest, to keep CI under 6 min
