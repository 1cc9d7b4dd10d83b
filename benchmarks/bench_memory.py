"""Peak memory of a CPU training step with and without fuse-lm-head-ce (8-layer network, batch 4).

Each variant runs in a fresh process (so one cannot inherit the other's
heap), builds the network as `vgraph train` does (float32 on the CPU, Adam),
takes one warm-up step (Adam's moments now exist) and then measures a step,
forward + backward + Adam, three ways:

* **tensor peak** (`vgraph.backends.torch.training.peak_memory.LiveTensorBytes`): a
  TorchDispatchMode sees every tensor any aten op allocates during the step (forward, backward and optimizer) and follows each storage
  until it is freed (a weakref finalizer on the storage), so the maximum of
  the live bytes is the step's allocation peak above what existed before it,
  independent of the C allocator's caching;
* **largest tensor**, overall and among tensors whose last dim is the
  vocabulary: the proof that the fused step never forms the [B, S, V] logits;
* **peak RSS delta**: the kernel's high-water mark of the process (VmHWM,
  reset through /proc/self/clear_refs just before the step) minus the RSS
  before it, which includes what malloc keeps.

Also shown: `vgraph.backends.torch.estimate_training_memory`'s activation +
workspace terms for the same step, and the parameter + Adam bytes that exist
before and after the step.

    .venv/bin/python benchmarks/bench_memory.py [--network 8] [--batch 4] [--threads 2]
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NETWORKS = {
    "8": ROOT / "networks" / "distributed_attention_example_8_swiglu_head_vocab32768_seq512.yml",
    "6": ROOT / "networks" / "distributed_attention_example_6_swiglu_head.yml",
    "tiny": ROOT / "tests" / "fixtures" / "tiny_2l.yml",
}
PIPELINES = {
    "fused (production pipeline)": None,
    "without fuse-lm-head-ce": "dead-nodes,precision,fuse-heads",
}
MIB = 2**20


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def child(network: str, passes: str | None, batch: int, threads: int) -> dict:
    import torch

    from vgraph.backends.torch.training.peak_memory import LiveTensorBytes
    from train_step_fixture import training_step
    from vgraph.backends.torch import estimate_training_memory

    torch.set_num_threads(threads)
    graph, module, optimizers, step, vocab, seq = training_step(NETWORKS[network], passes, batch,
                                                                keyed_dropout=False)

    torch.manual_seed(0)  # the same dropout masks in both processes: comparable first-step losses
    first_loss = step()  # warm-up: Adam's moments are allocated here

    def state_bytes() -> int:
        total = sum(p.numel() * p.element_size() for p in module.parameters())
        for opt in optimizers.optimizers:
            for st in opt.state.values():
                total += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
        return total

    # 1. peak RSS delta
    gc.collect()
    rss_before = _status_kib("VmRSS")
    reset = _reset_peak_rss()
    step()
    rss_peak = _status_kib("VmHWM")

    # 2. tensor peak and largest tensors (peak_memory.LiveTensorBytes)
    gc.collect()
    tracker = LiveTensorBytes(vocab=vocab)  # the step's allocations above what existed before it
    with tracker:
        step()
    estimate = estimate_training_memory(graph, batch)
    return {
        "vnodes": len(graph), "passes": graph.meta.get("applied_passes", []), "loss": first_loss,
        "tensor_peak": tracker.peak, "largest": tracker.largest, "largest_vocab": tracker.largest_vocab,
        "rss_before": rss_before * 1024, "rss_delta": (rss_peak - rss_before) * 1024 if reset else None,
        "state_bytes": state_bytes(), "logits_numel": batch * seq * vocab, "vocab": vocab, "seq": seq,
        "estimate_step": estimate.activations + estimate.workspace, "estimate_total": estimate.total,
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--network", choices=sorted(NETWORKS), default="8")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        passes = None if args.child == "-" else args.child
        print(json.dumps(child(args.network, passes, args.batch, args.threads)))
        return 0

    rows = {}
    for label, passes in PIPELINES.items():
        cmd = [sys.executable, __file__, "--network", args.network, "--batch", str(args.batch),
               "--threads", str(args.threads), "--child", passes or "-"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr, file=sys.stderr)
            return 1
        rows[label] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"measured {label}", file=sys.stderr)

    first = next(iter(rows.values()))
    shape = lambda s: "x".join(map(str, s)) or "-"  # noqa: E731
    print(f"\n### Training-step memory, {NETWORKS[args.network].stem}, batch {args.batch} x {first['seq']} tokens, "
          f"CPU float32\n")
    print(f"Command: `.venv/bin/python benchmarks/bench_memory.py {' '.join(argv or sys.argv[1:])}`".rstrip())
    print(f"\nMachine: {platform.machine()} {os.cpu_count()}-core CPU, torch {first['torch']}, {args.threads} threads. "
          f"Date: {datetime.date.today().isoformat()}. One fresh process per variant; the measured step is the "
          f"second (Adam's moments exist). The logits would be {args.batch} x {first['seq']} x {first['vocab']} = "
          f"{first['logits_numel']:,} floats = {first['logits_numel'] * 4 / MIB:.0f} MiB in float32.\n")
    print("| variant | VNodes | tensor peak of the step (MiB) | peak RSS delta (MiB) | estimate: activations + "
          "workspace (MiB) | params + Adam (MiB) | largest tensor | largest [..., V] tensor | logits formed |")
    print("|---|---:|---:|---:|---:|---:|---|---|---|")
    for label, r in rows.items():
        formed = "yes" if r["largest_vocab"][0] >= r["logits_numel"] else "no"
        rss = "-" if r["rss_delta"] is None else f"{r['rss_delta'] / MIB:.0f}"
        print(f"| {label} | {r['vnodes']} | {r['tensor_peak'] / MIB:.0f} | {rss} | {r['estimate_step'] / MIB:.0f} | "
              f"{r['state_bytes'] / MIB:.0f} | {shape(r['largest'][1])} | {shape(r['largest_vocab'][1])} | {formed} |")
    fused, plain = rows["fused (production pipeline)"], rows["without fuse-lm-head-ce"]
    print(f"\nfuse-lm-head-ce saves {(plain['tensor_peak'] - fused['tensor_peak']) / MIB:.0f} MiB of the step's tensor "
          f"peak ({fused['tensor_peak'] / plain['tensor_peak']:.2f}x)"
          + (f" and {(plain['rss_delta'] - fused['rss_delta']) / MIB:.0f} MiB of peak RSS"
             if fused["rss_delta"] is not None and plain["rss_delta"] is not None else "")
          + f". First-step losses (same weights and data): {fused['loss']:.6f} (fused), {plain['loss']:.6f} "
            f"(without).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
