#!/usr/bin/env bash
# The test command: set up .venv, then run the whole suite (extra args go to pytest).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/tools/setup_env.sh"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest -q "$@"
