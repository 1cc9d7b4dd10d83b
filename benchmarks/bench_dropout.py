"""Keyed dropout vs `F.dropout` on the global RNG, at the 6-layer network's dropout shapes.

Goal (issue 12): the counter-based keyed masks of `vgraph train` / `vgraph
launch` (backends/torch/lowering/dropout.py) cost at most 1.05x what `F.dropout` costs
on a CPU.  The 6-layer network has 12 dropout VNodes, each on a `[B, 128, 512]`
activation (B = 8 by default, `vgraph train`'s batch).  Per round, every
variant runs back to back (the order alternates), and the ratio of a round is
keyed / F.dropout of that round; the table gives medians, so the load of a
shared machine cancels out of the ratio.

Variants: forward only (the 12 dropouts of one step) and forward + backward
(what a training step pays), in float32 and bfloat16 (the CUDA compute dtype;
on a CPU for the mask's cost, which does not depend on the dtype).

    .venv/bin/python benchmarks/bench_dropout.py [--batch 8] [--rounds 15] [--threads 2]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from rounds import paired_median, rotated, rounds_note  # noqa: E402
from vgraph.backends.torch.lowering.dropout import dropout_key, keyed_dropout, node_stream  # noqa: E402

NODES = [f"block{b}_{part}_dropout" for b in range(6) for part in ("attn", "ffn")]  # the 6-layer network's 12
RATE = 0.1


def one_step(xs: list[torch.Tensor], keyed: bool, backward: bool) -> None:
    """The 12 dropouts of a step (forward, and backward when asked)."""
    outs = []
    for x, node in zip(xs, NODES):
        outs.append(keyed_dropout(x, RATE, node, node_stream(node)) if keyed else F.dropout(x, RATE, training=True))
    if backward:
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        for x in xs:
            x.grad = None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = (args.batch, args.seq, args.dim)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for backward in (False, True):
            xs = [torch.randn(shape).to(dtype).requires_grad_(backward) for _ in NODES]
            times: dict[bool, list[float]] = {False: [], True: []}
            for step in range(args.rounds + 2):
                for keyed in rotated((True, False), step):
                    with dropout_key(0, step):
                        start = time.perf_counter()
                        one_step(xs, keyed, backward)
                        if step >= 2:  # the first two rounds warm the allocator up
                            times[keyed].append(time.perf_counter() - start)
            ratios = [k / f for k, f in zip(times[True], times[False])]
            rows.append((str(dtype).removeprefix("torch."), "forward + backward" if backward else "forward",
                         statistics.median(times[False]), statistics.median(times[True]),
                         paired_median(times[True], times[False]), min(ratios), max(ratios)))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"### Keyed dropout vs F.dropout: 12 dropouts of the 6-layer network, [{', '.join(map(str, shape))}] each, "
          f"p={RATE}")
    print()
    given = " ".join(sys.argv[1:] if argv is None else argv)
    print(f"Command: `.venv/bin/python benchmarks/bench_dropout.py{' ' + given if given else ''}`")
    print(f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} threads, "
          f"load average {load:.1f} at the end. Date: {datetime.date.today().isoformat()}. Medians of {args.rounds} "
          f"rounds, variants back to back in alternating order.")
    print()
    print("| dtype | pass | F.dropout (ms) | keyed (ms) | keyed / F.dropout (median) | min | max |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for dtype, what, base, keyed, ratio, lo, hi in rows:
        print(f"| {dtype} | {what} | {base * 1e3:.1f} | {keyed * 1e3:.1f} | {ratio:.2f}x | {lo:.2f}x | {hi:.2f}x |")
    print()
    print("keyed / F.dropout: " + "; ".join(f"{dtype} {what} {ratio:.2f}x" for dtype, what, _, _, ratio, _, _ in rows)
          + f" ({rounds_note(args.rounds)}, goal <= 1.05x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
