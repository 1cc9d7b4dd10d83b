#!/usr/bin/env bash
# The main job: set up .venv, then validate, analyze and optimize both production networks.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/tools/setup_env.sh"
cd "$ROOT"
VG="$VENV/bin/vgraph"
NETS=(networks/distributed_attention_example_6_swiglu_head.yml
      networks/distributed_attention_example_8_swiglu_head_vocab32768_seq512.yml)
echo "== validate"
"$VG" validate "${NETS[@]}"
for net in "${NETS[@]}"; do
  echo "== analyze $net"
  "$VG" analyze "$net" | tail -n 14
done
echo "== optimize (production pipeline) the 8-layer network"
"$VG" optimize "${NETS[1]}" -o "$ROOT/runs/optimized_8l.yml"
