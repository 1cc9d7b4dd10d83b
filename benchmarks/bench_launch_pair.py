"""`vgraph launch` on two devices of this machine vs `vgraph train` on one: the GPU check's 2-GPU row.

Blocks of the first half of the network and the embedding/LM-head group on
worker 0, the second half on worker 1 (a fixed placement: the partition pass
would put a network that fits on one device on one), over nccl on CUDA
(`launch` picks nccl when every local worker has a GPU of its own) and gloo
on a CPU.  Same steps, batch and seed for both runs; the table gives the
median step time after the first step (metrics.jsonl `elapsed_s`), tokens/s,
and the last losses, which agree to float rounding (`launch` is the same
training as `train`).  The corpus is a synthetic text file, so no tokenizer
for the embedded corpus has to be trained first.  With `--rounds N` both run N
times in an order that turns every round; a row gives the median over rounds,
and the last line launch / train, the median of the rounds' own ratios.

    python benchmarks/bench_launch_pair.py [--network 8] [--batch 32] [--steps 6] [--device cuda] [--rounds 1]
        [--words 60000] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from network_paths import NETWORK_FILES  # noqa: E402
from rounds import paired_median, rotated, rounds_note  # noqa: E402


def halves(graph, workers: int) -> dict[str, str]:
    """VNode -> PNode: transformer block b on worker b * workers // blocks; everything else on w0."""
    blocks = sorted({int(m.group(1)) for n in graph.nodes
                     if (m := re.fullmatch(r"transformer_block_(\d+)", str(n.cfg.get("colocate_group") or "")))})
    out = {}
    for node in graph.nodes:
        m = re.fullmatch(r"transformer_block_(\d+)", str(node.cfg.get("colocate_group") or ""))
        out[node.id] = f"w{blocks.index(int(m.group(1))) * workers // len(blocks)}" if m else "w0"
    return out


def corpus(path: Path, words: int = 60_000) -> None:
    rng = random.Random(0)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(4000)]
    path.write_text(" ".join(rng.choice(vocab) for _ in range(words)), encoding="utf-8")


def step_seconds(rows: list[dict]) -> float:
    times = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rows, rows[1:])]
    return statistics.median(times) if times else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--network", choices=sorted(NETWORK_FILES), default="8")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each, alternated (default 1)")
    ap.add_argument("--words", type=int, default=60_000,
                    help="words of the synthetic corpus (default 60,000; the CPU fallback of gpu_check.sh: 6,000)")
    ap.add_argument("--out", type=Path, help="also write the markdown table here")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.words < 1:
        ap.error(f"--words must be at least 1, got {args.words}")

    import torch

    import vgraph
    from vgraph.backends.torch import TrainConfig, train
    from vgraph.backends.torch.distributed.launcher.launch import LaunchConfig, launch
    from vgraph.backends.torch.training.config import TrainingError

    cuda = args.device.startswith("cuda")
    if cuda and torch.cuda.device_count() < args.workers:
        print(f"{torch.cuda.device_count()} GPU(s): a {args.workers}-GPU launch needs {args.workers}", file=sys.stderr)
        return 2
    backend = "nccl" if cuda and torch.distributed.is_nccl_available() else "gloo"
    path = NETWORK_FILES[args.network]
    graph = vgraph.load(path)
    work = Path(tempfile.mkdtemp(prefix="bench_launch_pair_"))
    try:
        corpus(work / "corpus.txt", args.words)
        (work / "fleet.yml").write_text("name: pair\npnodes:\n" + "".join(
            f"  - {{id: w{i}, memory: 64GiB, flops: 100T, bandwidth: 50GB/s, "
            f"accelerator: {'cuda-sm80' if cuda else 'cpu'}}}\n" for i in range(args.workers)))
        (work / "placement.json").write_text(json.dumps({"assignment": halves(graph, args.workers)}))
        common = dict(network=str(path), data=str(work / "corpus.txt"), steps=args.steps, batch=args.batch,
                      lr=3e-4, seed=0, val_every=0, checkpoint_every=0, progress=False, device=args.device)
        runs = {
            "train": lambda r: train(TrainConfig(**common, out=work / f"train{r}")).history,
            "launch": lambda r: launch(LaunchConfig(**common, out=work / f"launch{r}", fleet=str(work / "fleet.yml"),
                                                    micro_batches=args.micro_batches,
                                                    placement=str(work / "placement.json"),
                                                    log=lambda line: None)).history,
        }
        steps: dict[str, list[float]] = {way: [] for way in runs}
        walls: dict[str, list[float]] = {way: [] for way in runs}
        last: dict[str, float] = {}
        for r in range(args.rounds):
            for way in rotated(list(runs), r):
                start = time.perf_counter()
                try:
                    history = runs[way](r)
                except TrainingError as exc:  # e.g. a --words corpus too small for a window of the network
                    print(f"bench_launch_pair: {way}: {exc}", file=sys.stderr)
                    return 1
                walls[way].append(time.perf_counter() - start)
                steps[way].append(step_seconds(history))
                last[way] = history[-1]["loss"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tokens = args.batch * int(graph.nodes_of_type("embedder")[0].cfg["seq_len"])
    med = {way: (statistics.median(steps[way]), statistics.median(walls[way])) for way in runs}
    rows = [("vgraph train, 1 device", 1, "-", *med["train"][:1], last["train"], med["train"][1]),
            (f"vgraph launch, {args.workers} devices ({backend})", args.workers, args.micro_batches,
             *med["launch"][:1], last["launch"], med["launch"][1])]
    lines = [f"### `vgraph launch` on {args.workers} {'GPUs' if cuda else 'CPU workers'}: {graph.name}, batch "
             f"{args.batch}, {args.steps} steps",
             "",
             f"Command: `python benchmarks/bench_launch_pair.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
             f"Placement: blocks split in halves, the embedding/LM-head group with the first half. "
             f"torch {torch.__version__}.",
             "",
             "| run | devices | micro-batches | step (ms, median after step 1) | tokens/s | last loss | wall (s) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, devices, micro, step, loss, wall in rows:
        lines.append(f"| {name} | {devices} | {micro} | {step * 1e3:.1f} | {tokens / step:,.0f} | {loss:.6f} | "
                     f"{wall:.0f} |")
    lines += ["", f"launch / train step: {paired_median(steps['launch'], steps['train']):.3f} "
                  f"({rounds_note(args.rounds)})"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
