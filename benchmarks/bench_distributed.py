"""`vgraph launch` on this machine: step time of the 6-layer network on 1 vs 2 workers, and the bytes
that crossed PNode boundaries per step (counted by the workers) against the partition's prediction.

    .venv/bin/python benchmarks/bench_distributed.py [--steps 8] [--batch 4] [--micro-batches 1,2,4] [--rounds 2]

Rows, all in one run, alternating over `--rounds` (the order turning every round): the single-process
trainer (`vgraph train`, all cores and one core), `vgraph launch` on a one-PNode fleet
(one worker, all cores) and on a fleet of two equal PNodes (two workers, the
cores split between them) for each micro-batch count.  Step times are the per-step wall times after `--warmup`
steps (metrics.jsonl `elapsed_s`), the minimum (the machine's own cost, least
disturbed by other load) and the median; "x single" is the median over rounds of the round's ratio of
median steps to the single-process step's (all cores), and the last line gives the two-worker rows against
the one-thread process the same way (benchmarks/rounds.py).  The last loss of every row is printed too: the
rows are the same training, so it must agree to float rounding.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from rounds import paired_median, rotated, rounds_note  # noqa: E402

NET6 = ROOT / "networks" / "distributed_attention_example_6_swiglu_head.yml"


def _partition_pass() -> None:
    from vgraph.transform.pipeline import available_passes

    if "partition" not in available_passes():  # before the entry point is installed
        from vgraph.passes import partition as P
        from vgraph.transform.pass_api import register_pass

        register_pass(P.Partition)


def fleet_yaml(k: int) -> str:
    # Equal CPU PNodes on loopback: the partition balances compute, the bandwidth only prices the cut.
    return "name: cpu%d\npnodes:\n" % k + "".join(
        f"  - {{id: cpu{i}, memory: 8GiB, flops: 40G, bandwidth: 5GB/s, accelerator: cpu}}\n" for i in range(k))


def step_times(rows: list[dict], warmup: int) -> list[float]:
    times = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rows, rows[1:])]
    return times[max(0, warmup - 1):]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--network", default=str(NET6))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--micro-batches", default="1,2,4")
    ap.add_argument("--data", default=None, help="text corpus (default: the embedded one)")
    ap.add_argument("--rounds", type=int, default=2, help="times every configuration runs, alternating")
    args = ap.parse_args(argv)
    _partition_pass()

    import torch

    from vgraph.backends.torch import TrainConfig, train
    from vgraph.backends.torch.distributed.launcher.launch import LaunchConfig, launch

    cores = os.cpu_count() or 1
    work = Path(tempfile.mkdtemp(prefix="bench_dist_"))
    for k in (1, 2):
        (work / f"fleet{k}.yml").write_text(fleet_yaml(k))
    common = dict(network=args.network, data=args.data, steps=args.steps, batch=args.batch, lr=3e-4, seed=0,
                  val_every=0, checkpoint_every=0, progress=False)
    configs = [("train", 1, cores, "-"), ("train", 1, 1, "-"), ("launch", 1, cores, 1)]
    configs += [("launch", 2, max(1, cores // 2), int(m)) for m in args.micro_batches.split(",")]
    times: dict[int, list[float]] = {i: [] for i in range(len(configs))}
    per_round: dict[int, list[float]] = {i: [] for i in range(len(configs))}  # each round's median step
    last: dict[int, tuple] = {}
    try:
        for round_ in range(args.rounds):  # configurations alternate, so a noisy neighbour hits all alike
            for i, (kind, workers, threads, micro) in rotated(list(enumerate(configs)), round_):
                out = work / f"r{round_}_{i}"
                t = time.perf_counter()
                if kind == "train":
                    history = train(TrainConfig(**common, out=out, threads=threads)).history
                    last[i] = (history[-1]["loss"], None, None)
                else:
                    result = launch(LaunchConfig(**common, out=out, fleet=str(work / f"fleet{workers}.yml"),
                                                 micro_batches=micro, threads=threads, log=lambda line: None))
                    history = result.history
                    counts = {}
                    for pnode in result.placement["assignment"].values():
                        counts[pnode] = counts.get(pnode, 0) + 1
                    last[i] = (history[-1]["loss"], statistics.median(r["boundary_bytes"] for r in history),
                               result.placement["cut_bytes_per_step"])
                    print(f"  placement: {counts} VNodes per PNode", file=sys.stderr)
                times[i] += step_times(history, args.warmup)
                per_round[i].append(statistics.median(step_times(history, args.warmup)))
                print(f"round {round_}: {kind} {workers}x{threads} threads, micro {micro}: "
                      f"{time.perf_counter() - t:.1f} s", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for i, (kind, workers, threads, micro) in enumerate(configs):
        name = "vgraph train (1 process)" if kind == "train" else f"vgraph launch, {workers} worker(s)"
        rows.append((name, workers, threads, micro, times[i], per_round[i], *last[i]))

    print(f"6-layer network {Path(args.network).name}, batch {args.batch}, {args.steps} steps x {args.rounds} "
          f"rounds (steps {args.warmup + 1}..{args.steps} of every round), fp32 CPU, torch {torch.__version__}, "
          f"{cores} cores")
    print()
    print("| run | workers | threads/worker | micro-batches | step s (min) | step s (median) | x single (median of "
          "rounds) | boundary bytes/step measured | predicted (placement) | last loss |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, workers, threads, micro, times, rounds, loss, measured, predicted in rows:
        m = f"{int(measured):,}" if measured is not None else "-"
        p = f"{int(predicted):,}" if predicted is not None else "-"
        print(f"| {name} | {workers} | {threads} | {micro} | {min(times):.3f} | {statistics.median(times):.3f} | "
              f"{paired_median(rounds, rows[0][5]):.2f} | {m} | {p} | {loss:.6f} |")
    one_thread = rows[1][5]  # vgraph train on one core: what two one-core workers are held against
    print(f"\n2 workers / 1 process of 1 thread, by micro-batches: " + "; ".join(
        f"{micro}: {paired_median(rounds, one_thread):.2f}" for _, workers, _, micro, _, rounds, *_ in rows
        if workers == 2) + f" ({rounds_note(args.rounds)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
