#!/usr/bin/env bash
# Create or refresh the project's virtual environment at .venv (idempotent).
# Sourced by tools/main.sh and tools/test.sh; safe to run on its own.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
# torch: the CPU build that this machine kind keeps on disk unless told otherwise
# (VGRAPH_TORCH="torch==2.13.0" by default; set it to e.g. "torch" on a CUDA machine).
TORCH_SPEC="${VGRAPH_TORCH:-torch==2.13.0}"
STAMP="$VENV/.vgraph-stamp"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/tools/setup_env.sh" | sha256sum | cut -c1-16) $TORCH_SPEC"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing vgraph and its dependencies into .venv"
  "$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel
  "$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
  "$VENV/bin/python" -m pip install -q -e "$ROOT[dev,bench]"  # extras: the tests' and the benchmarks' own needs
  echo "$want" > "$STAMP"
fi

# System programs some commands and tests need, installed through the system package manager when
# permitted (root with apt-get), else named with the command that installs them.
install_system_program() {  # PROGRAM PACKAGE PURPOSE [OTHER NAMES OF THE PROGRAM...]
  local program="$1" package="$2" purpose="$3"
  shift 3
  for name in "$program" "$@"; do
    command -v "$name" >/dev/null 2>&1 && return 0
  done
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing $package ($purpose) with apt-get"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$package" >/dev/null) \
      || echo "[setup] could not install $package; $purpose needs it (apt-get install $package)" >&2
  else
    echo "[setup] '$program' not found: install it (e.g. 'sudo apt-get install $package') for $purpose" >&2
  fi
}

# Graphviz's `dot` renders SVGs (vgraph render, vgraph report).
install_system_program dot graphviz "'vgraph render'"
# Chromium renders `vgraph report` pages headless in the tests (a real browser, not a parser).
install_system_program chromium chromium "the browser tests of 'vgraph report'" chromium-browser
