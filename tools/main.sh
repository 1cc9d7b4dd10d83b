#!/usr/bin/env bash
# The main job: set up .venv, validate, analyze and optimize both production networks, then train the
# 6-layer network for a few minutes on the embedded corpus (no downloads) and show the loss falling.
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
  "$VG" analyze "$net" | sed -n '1p;/^colocation group/,$p'  # the totals and the per-group table
done
for net in "${NETS[@]}"; do
  echo "== optimize (production pipeline) $net"
  "$VG" optimize "$net" -o "$ROOT/runs/optimized_$(basename "$net")"
done

echo "== train the 6-layer network on the embedded corpus (CPU float32, batch 8 x 128 tokens, ~4-6.5 min on 2 cores)"
RUN="$ROOT/runs/main_train_6l"
rm -rf "$RUN"
# On a machine whose cores other processes share, OpenMP's default spin-waiting stalls
# torch at every op a competitor delays; passive waiting avoids that (BENCHMARKS.md).
OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}" "$VG" train "${NETS[0]}" --device cpu --threads 2 \
  --steps 160 --batch 8 --val-every 40 --val-batches 4 --out "$RUN"   # set-up phases, then a line every 10 steps
"$VENV/bin/python" - "$RUN" <<'PY'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
def mean(xs): return sum(xs) / len(xs)
head, tail = [r["loss"] for r in rows[:10]], [r["loss"] for r in rows[-10:]]
print(f"loss: step 1 {rows[0]['loss']:.3f}, steps 1-10 mean {mean(head):.3f} -> steps {rows[-10]['step']}-"
      f"{rows[-1]['step']} mean {mean(tail):.3f} (step {rows[-1]['step']} {rows[-1]['loss']:.3f})")
val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
print("validation loss: " + ", ".join(f"step {s} {v:.3f}" for s, v in val))
print(f"{rows[-1]['elapsed_s']:.0f} s, {mean([r['tokens_per_s'] for r in rows[1:]]):,.0f} tokens/s; "
      f"curve: {run / 'loss_curve.png'}")
if not mean(tail) < mean(head) - 1.0:
    sys.exit("the training loss did not fall")
PY
