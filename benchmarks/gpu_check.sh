#!/usr/bin/env bash
# The GPU check, as one command for a session that has the GPU machine (an H200):
#
#   bash benchmarks/gpu_check.sh            # 8-layer network, batch 128, CUDA, eager + torch.compile
#
# It trains the 8-layer production network at batch 128 with the production precision
# policy (bf16 autocast from sm80, fp32 master weights and loss) and writes the markdown
# table of benchmarks/bench_gpu.py (step time, tokens/s, MFU, peak memory with and without
# fuse-lm-head-ce, the largest tensor of a step) to $OUT (or runs/gpu_check/) and stdout.
# Budget: the benchmark stops adding variants after --budget-s (default 420 s here), and the
# whole command is cut at 560 s, so it ends well inside a 10-minute device call.
#
# Python: the machine's own torch is used when there is one (the GPU machine has CUDA torch
# preinstalled and no network), with vgraph laid out in a temporary site directory beside
# it (no pip, no download, the machine's packages untouched).  Without a torch, the project
# venv is created with VGRAPH_TORCH=torch (needs a package index).
# Extra arguments go to bench_gpu.py; to check the script on a CPU:
#   PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh --device cpu --network tiny --batch 4 --rounds 2
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
RESULTS="${OUT:-$ROOT/runs/gpu_check}"
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu_check.log"
: > "$LOG"
say() { echo "[gpu_check] $*" | tee -a "$LOG" >&2; }

PY="${PYTHON:-python3}"
if "$PY" -c "import torch" >/dev/null 2>&1; then
  say "using the machine's torch: $("$PY" -c 'import torch; print(torch.__version__, "cuda" if torch.cuda.is_available() else "no cuda")') ($(command -v "$PY" || echo "$PY"))"
  SITE="$(mktemp -d /tmp/vgraph-site.XXXXXX)"
  trap 'rm -rf "$SITE"' EXIT
  # Lay vgraph out as an install would (package-dir mapping + entry points), from pyproject.toml.
  "$PY" - "$ROOT" "$SITE" <<'EOF'
import shutil, sys, tomllib
from pathlib import Path
root, site = Path(sys.argv[1]), Path(sys.argv[2])
cfg = tomllib.loads((root / "pyproject.toml").read_text())
ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
for package, source in cfg["tool"]["setuptools"]["package-dir"].items():
    shutil.copytree(root / source, site / package.replace(".", "/"), ignore=ignore, dirs_exist_ok=True)
project = cfg["project"]
info = site / f"{project['name']}-{project['version']}.dist-info"
info.mkdir()
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
(info / "entry_points.txt").write_text("".join(
    f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in entries.items()) + "\n"
    for group, entries in project.get("entry-points", {}).items()))
EOF
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
  say "no torch for $PY: creating the project venv with VGRAPH_TORCH=${VGRAPH_TORCH:-torch}"
  export VGRAPH_TORCH="${VGRAPH_TORCH:-torch}"
  # shellcheck source=/dev/null
  source "$ROOT/tools/setup_env.sh"
  PY="$VENV/bin/python"
fi
"$PY" -c "import vgraph, vgraph.backends.torch, yaml, networkx, tokenizers" \
  || { say "vgraph or one of its dependencies does not import with $PY"; exit 1; }
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm \
  --format=csv 2>&1 | tee -a "$LOG" || true

export PYTHONUNBUFFERED=1
set -o pipefail
timeout 560 "$PY" benchmarks/bench_gpu.py --network 8 --batch 128 --device cuda --compile --budget-s 420 \
  --out "$RESULTS/gpu_results.md" "$@" 2>&1 | tee -a "$LOG"
say "table: $RESULTS/gpu_results.md (raw numbers: $RESULTS/gpu_results.json, log: $LOG)"
