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
# onnxruntime: the CPU build (the base dependency) unless this machine has an NVIDIA GPU (nvidia-smi lists one)
# or VGRAPH_ONNXRUNTIME=gpu asks for the CUDA build (the `gpu` extra); VGRAPH_ONNXRUNTIME=cpu forces the CPU one.
# Both builds install the same `onnxruntime` module, so the other one is removed (one_onnxruntime below).
if [ -z "${VGRAPH_ONNXRUNTIME:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    VGRAPH_ONNXRUNTIME=gpu
  else
    VGRAPH_ONNXRUNTIME=cpu
  fi
fi
case "$VGRAPH_ONNXRUNTIME" in
  cpu) EXTRAS="dev,bench" ;;
  gpu) EXTRAS="dev,bench,gpu" ;;
  *) echo "[setup] VGRAPH_ONNXRUNTIME must be cpu or gpu, got '$VGRAPH_ONNXRUNTIME'" >&2; exit 2 ;;
esac
STAMP="$VENV/.vgraph-stamp"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/tools/setup_env.sh" | sha256sum | cut -c1-16) $TORCH_SPEC $VGRAPH_ONNXRUNTIME"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
# uv where it can be had (pip installs it): the same packages from the same places as pip, which it is told
# from pip's own configuration (uv_args below), in 9.5 s where pip takes 43 s (a clean clone on this 2-core
# machine kind, uv's cache empty; CI counts the set-up in the suite's six minutes).  pip when uv cannot be
# installed or fails.
uv_args() {  # pip's configured package sources, certificate and constraints as uv options, one per line
  "$VENV/bin/python" - <<'PY'
import subprocess, sys
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
flags = {"find-links": "--find-links", "extra-index-url": "--extra-index-url", "index-url": "--index-url",
         "constraint": "--constraint"}
for line in out.splitlines():
    key, _, value = line.partition("=")
    name = key.rpartition(".")[2]
    for item in value.strip().strip("'\"").split():
        if name in flags:
            print(flags[name]); print(item)
PY
}
install_with_uv() {
  # a machine without the index answers within seconds, not after pip's configured timeouts and retries
  "$VENV/bin/python" -m pip install -q --timeout 15 --retries 1 uv >/dev/null 2>&1 || return 1
  local args cert=()
  mapfile -t args < <(uv_args)
  # pip's certificate bundle (PIP_CERT) for uv, which reads SSL_CERT_FILE; nothing when neither is set
  [ -n "${SSL_CERT_FILE:-${PIP_CERT:-}}" ] && cert=("SSL_CERT_FILE=${SSL_CERT_FILE:-$PIP_CERT}")
  env ${cert[@]+"${cert[@]}"} "$VENV/bin/uv" pip install -q --compile-bytecode --python "$VENV/bin/python" "${args[@]}" \
    pip setuptools wheel "$TORCH_SPEC" -e "$ROOT[$EXTRAS]" && one_onnxruntime uv
}
# Leave exactly one onnxruntime build: uninstalling the other deletes the module files both share, so the one
# wanted is reinstalled over them, at the version installed.  Argument: uv or pip (the installer used).
one_onnxruntime() {
  local other=onnxruntime-gpu wanted=onnxruntime spec
  [ "$VGRAPH_ONNXRUNTIME" = gpu ] && other=onnxruntime wanted=onnxruntime-gpu
  "$VENV/bin/python" -m pip show -q "$other" >/dev/null 2>&1 || return 0
  spec="$(pip_spec "$wanted")"
  echo "[setup] replacing $other with $wanted (both install the module onnxruntime)"
  if [ "$1" = uv ]; then
    "$VENV/bin/uv" pip uninstall -q --python "$VENV/bin/python" "$other" &&
      env ${cert[@]+"${cert[@]}"} "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" "${args[@]}" \
        --reinstall --no-deps "$spec"
  else
    "$VENV/bin/python" -m pip uninstall -q -y "$other" &&
      "$VENV/bin/python" -m pip install -q --force-reinstall --no-deps "$spec"
  fi
}
pip_spec() {  # the version of $1 now installed, pinned, so the reinstall does not change it
  "$VENV/bin/python" -m pip show "$1" 2>/dev/null | awk -v n="$1" '/^Version:/ {print n "==" $2}'
}
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing vgraph and its dependencies into .venv"
  if ! install_with_uv; then
    echo "[setup] uv unavailable: installing with pip"
    "$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel
    "$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
    "$VENV/bin/python" -m pip install -q -e "$ROOT[$EXTRAS]"  # extras: the tests' and the benchmarks' own needs
    one_onnxruntime pip
  fi
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
