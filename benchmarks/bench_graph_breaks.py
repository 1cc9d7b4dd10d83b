"""torch.compile graph breaks of the training step: production networks, fused and unfused, every precision.

Goal (issue 12): zero.  Each break in a compiled step is, on a GPU, a device
sync and a fresh set of kernel launches every step.  Counted with
`torch._dynamo.explain` (backends/torch/lowering/graph_breaks.py), which traces the
program exactly as `torch.compile` does, under the trainer's autocast and
dropout key, without compiling: so the 8-layer network is counted in seconds
on a CPU.  Rows:

* `vgraph train --compile`'s program for each network x pipeline (production
  = fused, `--no-fuse` = unfused) x target (cpu: float32, cuda-sm80: bf16
  autocast, cuda-sm75: fp16 autocast with loss scaling);
* `vgraph launch`'s stage programs of the 6-layer network with its blocks
  spread over three PNodes (one row per PNode x stage);
* with `--train`, the acceptance command itself:
  `TORCH_LOGS=graph_breaks vgraph train tests/fixtures/tiny_2l.yml --compile --steps 3`
  (inductor; minutes on a CPU), counting the logged breaks.

    .venv/bin/python benchmarks/bench_graph_breaks.py [--networks 6,8] [--train]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

import vgraph  # noqa: E402
from vgraph.backends.torch import compute_dtype, prepare_graph  # noqa: E402
from vgraph.backends.torch.lowering.graph_breaks import stage_breaks, training_breaks  # noqa: E402
from network_paths import LABELS, NETWORK_FILES  # noqa: E402

TARGETS = ("cpu", "cuda-sm80", "cuda-sm75")  # --targets picks; the fp16 (sm75) program differs from bf16 in dtype only


def launch_rows(label: str, path: Path, pnodes: int = 3) -> list[tuple[str, str, str, int, int, float]]:
    """Stage programs of `path` with transformer block i on PNode i % pnodes (embedding and head on w0)."""
    from vgraph.backends.torch.distributed.launcher.launch import place, split_pipeline
    from vgraph.cost.fleet import loads_fleet

    graph = vgraph.load(path)
    assignment = {}
    for node in graph.nodes:
        group = str(node.cfg.get("colocate_group") or "")
        block = re.fullmatch(r"transformer_block_(\d+)", group)
        assignment[node.id] = f"w{int(block.group(1)) % pnodes}" if block else "w0"
    fleet = loads_fleet("name: bench\npnodes:\n" + "".join(
        f"  - {{id: w{i}, memory: 64GiB, flops: 10T, bandwidth: 10GB/s, accelerator: cpu}}\n"
        for i in range(pnodes)))
    before, partition, after = split_pipeline(None, True, {"batch": "8", "micro_batches": "2"})
    rows = []
    for target in ("cuda-sm80",):
        placed = place(graph, fleet, before=before, partition=partition, after=after, target=target, batch=8,
                       micro_batches=2, assignment=assignment)
        start = time.perf_counter()
        reports = stage_breaks(placed.graph, placed.final, placed.ranks)
        per = (time.perf_counter() - start) / max(len(reports), 1)
        for r in reports:
            rows.append((f"{label} launch stage {r.name}", "fused", target, r.graphs, r.breaks, per))
    return rows


def train_with_log(network: Path) -> tuple[int, float, str]:
    """Run the acceptance command; (logged graph breaks, seconds, last line)."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "vgraph.cli.main", "train", str(network), "--compile", "--steps", "3",
               "--batch", "2", "--val-every", "0", "--corpus-bytes", "20000", "--out", out, "--quiet",
               "--device", "cpu"]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TORCH_LOGS": "graph_breaks"})
        seconds = time.perf_counter() - start
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"vgraph train --compile failed ({proc.returncode}):\n{log[-3000:]}")
    breaks = len(re.findall(r"Graph break", log, flags=re.IGNORECASE))
    return breaks, seconds, log.strip().splitlines()[-1] if log.strip() else ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--networks", default="6,8", help=f"comma-separated from {', '.join(NETWORK_FILES)}")
    ap.add_argument("--targets", default="cpu,cuda-sm80", help=f"comma-separated from {', '.join(TARGETS)}")
    ap.add_argument("--train", action="store_true", help="also run TORCH_LOGS=graph_breaks vgraph train --compile "
                                                          "on the tiny network (inductor: minutes on a CPU)")
    args = ap.parse_args(argv)
    rows = []
    for key in [k.strip() for k in args.networks.split(",") if k.strip()]:
        path = NETWORK_FILES[key]
        for fuse in (True, False):
            for target in [t.strip() for t in args.targets.split(",") if t.strip()]:
                graph = prepare_graph(vgraph.load(path), fuse=fuse, target=target)
                start = time.perf_counter()
                r = training_breaks(graph)
                rows.append((f"{LABELS[key]} train", "fused" if fuse else "unfused",
                             f"{target} ({str(compute_dtype(graph)).removeprefix('torch.')})", r.graphs, r.breaks,
                             time.perf_counter() - start))
                print(f"  {rows[-1]}", file=sys.stderr, flush=True)
                for reason in r.reasons:
                    print(f"  break: {reason}", file=sys.stderr, flush=True)
        if key == "6":
            rows += launch_rows(LABELS[key], path)
    given = " ".join(sys.argv[1:] if argv is None else argv)
    print("### Graph breaks of the compiled training step (`torch._dynamo.explain`)")
    print()
    print(f"Command: `.venv/bin/python benchmarks/bench_graph_breaks.py{' ' + given if given else ''}`")
    print(f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}. "
          f"Date: {datetime.date.today().isoformat()}. Batch 2 for tracing (the count does not depend on it).")
    print()
    print("| program | pipeline | target (compute) | graphs | graph breaks | trace (s) |")
    print("|---|---|---|---:|---:|---:|")
    for name, pipe, target, graphs, breaks, seconds in rows:
        print(f"| {name} | {pipe} | {target} | {graphs} | {breaks} | {seconds:.1f} |")
    if args.train:
        breaks, seconds, last = train_with_log(NETWORK_FILES["tiny"])
        print()
        print(f"`TORCH_LOGS=graph_breaks vgraph train tests/fixtures/tiny_2l.yml --compile --steps 3 --batch 2` "
              f"(inductor, CPU): {breaks} graph break lines logged, {seconds:.0f} s; last line: `{last}`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
