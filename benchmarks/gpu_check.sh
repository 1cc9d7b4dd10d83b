#!/usr/bin/env bash
# The GPU check, as one command for a session that has the GPU machine (an H200):
#
#   bash benchmarks/gpu_check.sh            # 8-layer network, batch 128, CUDA, eager + torch.compile
#
# It trains the 8-layer production network at batch 128 with the production precision
# policy (bf16 autocast from sm80, fp32 master weights and loss) and writes the markdown
# table of benchmarks/bench_gpu.py (step time, tokens/s, MFU, peak memory, the largest
# tensor of a step, graph breaks; vgraph fused vs unfused vs the hand-written model, eager
# and compiled) to $OUT (or runs/gpu_check/) and stdout, ready to paste into BENCHMARKS.md.
# With two or more GPUs it then runs `vgraph launch` over nccl on two of them (blocks 0-3
# and the embedding/head on one, blocks 4-7 on the other) and appends its step time.
# Budget: the benchmark stops adding variants after --budget-s (360 s here) and is cut at
# 450 s; the launch is cut at 75 s (180 s in the CPU fallback): at most 9 minutes with the set-up.
#
# Without CUDA (a CPU machine, or the test suite's smoke test) the same code runs on tiny
# shapes: the tiny network at batch 4, torch.compile with the aot_eager backend (dynamo and
# AOT autograd without code generation), the launch with two CPU workers over gloo on a smaller
# synthetic corpus.
#
# Python: the machine's own torch is used when there is one (the GPU machine has CUDA torch
# preinstalled and no network), with vgraph laid out in a temporary site directory beside
# it (no pip, no download, the machine's packages untouched).  Without a torch, the project
# venv is created with VGRAPH_TORCH=torch (needs a package index).
# Extra arguments go to bench_gpu.py (they override the defaults); to check the script on a CPU:
#   PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
RESULTS="${OUT:-$ROOT/runs/gpu_check}"
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu_check.log"
: > "$LOG"
say() { echo "[gpu_check] $*" | tee -a "$LOG" >&2; }

PY="${PYTHON:-python3}"
# Each Python start below imports torch (seconds on a CPU), so each asks all it needs at once: the site is laid
# out first (the standard library only), then one start checks torch, vgraph from the site and the GPU count.
SITE="$(mktemp -d /tmp/vgraph-site.XXXXXX)"
trap 'rm -rf "$SITE"' EXIT
# Lay vgraph out as an install would (package-dir mapping + entry points), from pyproject.toml.
lay_out_site() {
  "$PY" - "$ROOT" "$SITE" <<'EOF'
import re, shutil, sys, tomllib
from pathlib import Path
root, site = Path(sys.argv[1]), Path(sys.argv[2])
cfg = tomllib.loads((root / "pyproject.toml").read_text())
ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
for package, source in cfg["tool"]["setuptools"]["package-dir"].items():
    shutil.copytree(root / source, site / package.replace(".", "/"), ignore=ignore, dirs_exist_ok=True)
project = cfg["project"]
version = project.get("version") or re.search(r'^__version__ = "([^"]+)"', (root / "vgraph" / "__init__.py").read_text(),
                                              re.M).group(1)  # dynamic: vgraph.__version__ is the source
info = site / f"{project['name']}-{version}.dist-info"
info.mkdir()
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {version}\n")
(info / "entry_points.txt").write_text("".join(
    f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in entries.items()) + "\n"
    for group, entries in project.get("entry-points", {}).items()))
EOF
}
# Exit 3: no torch for this Python; any other failure: vgraph or a dependency does not import.  The torch line
# comes first, the GPU count last (whatever an import printed between them).
PROBE='import sys
try:
    import torch
except Exception:
    sys.exit(3)
print("torch:", torch.__version__, "cuda" if torch.cuda.is_available() else "no cuda", flush=True)
import vgraph, vgraph.backends.torch, yaml, networkx, tokenizers
print(torch.cuda.device_count() if torch.cuda.is_available() else 0)'
probe_rc=0
if lay_out_site 2>/dev/null; then
  PROBED="$(PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c "$PROBE")" || probe_rc=$?
else
  probe_rc=3  # a Python without tomllib (before 3.11): the project venv below
fi
if [ "$probe_rc" -eq 0 ]; then
  say "using the machine's torch: $(printf '%s\n' "$PROBED" | sed -n 's/^torch: //p' | head -n 1) ($(command -v "$PY" || echo "$PY"))"
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  GPUS="$PROBED"
elif [ "$probe_rc" -eq 3 ]; then
  say "no torch for $PY: creating the project venv with VGRAPH_TORCH=${VGRAPH_TORCH:-torch}"
  export VGRAPH_TORCH="${VGRAPH_TORCH:-torch}"
  # shellcheck source=/dev/null
  source "$ROOT/tools/setup_env.sh"
  PY="$VENV/bin/python"
  GPUS="$("$PY" -c "$PROBE")" || { say "vgraph or one of its dependencies does not import with $PY"; exit 1; }
else
  say "vgraph or one of its dependencies does not import with $PY (the site laid out from this checkout)"
  exit 1
fi
GPUS="${GPUS##*$'\n'}"  # the count is the last line, whatever an import printed before it
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm \
  --format=csv 2>&1 | tee -a "$LOG" || true

export PYTHONUNBUFFERED=1
set -o pipefail
if [ "$GPUS" -ge 1 ]; then
  BENCH=(--network 8 --batch 128 --device cuda --compile --budget-s 360)
  LAUNCH=(--network 8 --batch 32 --steps 6 --device cuda --workers 2)
  LAUNCH_S=75
else
  say "no CUDA: the CPU fallback (tiny shapes, aot_eager compile, launch over gloo)"
  BENCH=(--network tiny --batch 4 --device cpu --variants fused,unfused,handwritten --compile
         --compile-variants fused --compile-backend aot_eager --rounds 2 --steps-per-round 1 --warmup 1
         --budget-s 200)
  # a tenth of the synthetic corpus: 3 steps of batch 4 x 16 tokens need thousands of tokens, not 60,000 words
  LAUNCH=(--network tiny --batch 4 --steps 3 --device cpu --workers 2 --words 6000)
  # a train and a 2-worker launch of the tiny network took 83-101 s at load 11-15 on the shared 2-core VM
  LAUNCH_S=180
fi
timeout 450 "$PY" benchmarks/bench_gpu.py "${BENCH[@]}" --out "$RESULTS/gpu_results.md" "$@" 2>&1 | tee -a "$LOG"
if [ "$GPUS" -ge 2 ] || [ "$GPUS" -eq 0 ]; then
  timeout "$LAUNCH_S" "$PY" benchmarks/bench_launch_pair.py "${LAUNCH[@]}" --out "$RESULTS/launch_results.md" 2>&1 \
    | tee -a "$LOG" || say "the 2-worker launch did not finish (see $LOG)"
else
  say "one GPU: no 2-GPU launch"
fi
say "table: $RESULTS/gpu_results.md (raw numbers: $RESULTS/gpu_results.json, log: $LOG)"
