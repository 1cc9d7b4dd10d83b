"""Default pass pipeline timing: 8-layer production network and generated networks.

Targets (issue 3): under 20 ms for the 8-layer network (verification after
every pass included), linear growth on generated networks up to 100k VNodes.

    .venv/bin/python benchmarks/bench_passes.py [--sizes 1000,10000,100000] [--repeat 7]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.gen_networks import synthetic  # noqa: E402
from vgraph import load  # noqa: E402
from vgraph.transform.pipeline import DEFAULT_PIPELINE, PassManager  # noqa: E402

NET8 = Path(__file__).resolve().parent.parent / "networks" / \
    "distributed_attention_example_8_swiglu_head_vocab32768_seq512.yml"


def time_pipeline(graph, repeat: int) -> tuple[float, PassManager]:
    PassManager(DEFAULT_PIPELINE).run(graph.copy())  # warm-up: imports the passes
    times, pm = [], None
    for _ in range(repeat):
        g = graph.copy()
        gc.collect()
        pm = PassManager(DEFAULT_PIPELINE)
        start = time.perf_counter()
        pm.run(g)
        times.append(time.perf_counter() - start)
    return statistics.median(times), pm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    rows = []
    t8, pm8 = time_pipeline(load(NET8), args.repeat)
    rows.append(("8-layer production", 183, len(pm8.records) and pm8.records[-1].nodes_after, t8))
    per_node = {}
    for n in (int(s) for s in args.sizes.split(",")):
        g = synthetic(n)
        t, pm = time_pipeline(g, max(1, args.repeat if n <= 10000 else 3))
        rows.append((f"synthetic {n}", len(g), pm.records[-1].nodes_after, t))
        per_node[n] = t
    print(f"pipeline: {DEFAULT_PIPELINE} (verification after every pass)")
    print(f"{'network':<22}{'VNodes in':>10}{'VNodes out':>12}{'median time':>14}{'us/VNode':>10}")
    for name, n_in, n_out, t in rows:
        print(f"{name:<22}{n_in:>10}{n_out:>12}{t * 1e3:>11.2f} ms{t / n_in * 1e6:>10.1f}")
    sizes = sorted(per_node)
    for a, b in zip(sizes, sizes[1:]):
        print(f"ratio {b}/{a}: {per_node[b] / per_node[a]:.2f} (linear = {b / a:.0f})")
    print(f"8-layer target < 20 ms: {'met' if t8 < 0.020 else 'NOT met'} ({t8 * 1e3:.2f} ms, median of "
          f"{args.repeat} runs)")
    print(pm8.report())


if __name__ == "__main__":
    main()
