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
  "$VENV/bin/python" -m pip install -q -e "$ROOT[test]"
  echo "$want" > "$STAMP"
fi

# Graphviz's `dot` renders SVGs; install it through the system package manager when permitted.
if ! command -v dot >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing Graphviz (dot) with apt-get"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz >/dev/null) \
      || echo "[setup] could not install graphviz; 'vgraph render' needs it (apt-get install graphviz)" >&2
  else
    echo "[setup] Graphviz 'dot' not found: install it (e.g. 'sudo apt-get install graphviz') for 'vgraph render'" >&2
  fi
fi
