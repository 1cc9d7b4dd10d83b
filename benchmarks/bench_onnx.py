"""Inference time: onnxruntime on vgraph's ONNX export vs the torch backend in eager mode.

Both run the same weights (the torch backend's seed-0 initialisation) on the
same token batch in float32, computing every output and cost (logits and the
mean cross-entropy), with the same number of threads.  The two are measured
alternately in one run (the order flips every round) so machine noise hits
both alike; the ratio is onnxruntime time / torch time (< 1: onnxruntime is
faster), the median over rounds of each round's own ratio (benchmarks/rounds.py).  GFLOP/s uses vgraph's forward FLOP count (the full S x S
attention square, as ``vgraph analyze`` counts it).

    .venv/bin/python benchmarks/bench_onnx.py [--batch 8] [--repeat 7] [--variants unfused,fused]
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import vgraph  # noqa: E402
from rounds import paired_median, rounds_note, timed_rounds  # noqa: E402
from vgraph.backends.onnx.check import _compile, _state_numpy, fp32_graph, random_feeds, session  # noqa: E402
from vgraph.backends.onnx import lower_network, value_name  # noqa: E402
from vgraph.cost.analyze import analyze  # noqa: E402

VARIANTS = {"unfused": "none", "fused": "fuse-heads,fuse-lm-head-ce"}
NET6 = Path(__file__).resolve().parent.parent / "networks" / "distributed_attention_example_6_swiglu_head.yml"


def measure(passes: str, batch: int, repeat: int, warmup: int) -> dict:
    graph = vgraph.load(NET6)
    if passes != "none":
        from vgraph.transform.pipeline import run_pipeline

        run_pipeline(graph, passes)
    graph = fp32_graph(graph)
    module = _compile(graph, seed=0)
    model = lower_network(graph, _state_numpy(module))
    sess = session(model, threads=torch.get_num_threads())
    feeds = random_feeds(graph, batch, seed=0)
    torch_feeds = {k: torch.from_numpy(v) for k, v in feeds.items()}
    names = [o.name for o in sess.get_outputs()]

    def run_torch():
        with torch.inference_mode():
            return module(torch_feeds)

    def run_ort():
        return sess.run(names, feeds)

    times = timed_rounds({"torch": run_torch, "onnxruntime": run_ort}, repeat, warmup)
    # Sanity: the two agree (check-onnx's tolerance), so the same work was timed.
    ref = run_torch()
    got = dict(zip(names, run_ort()))
    err = max(float(np.abs(got[value_name(ep.node, ep.slot)] - ref[ep.name].numpy()).max())
              for ep in [*graph.outputs, *graph.costs])
    t_torch = statistics.median(times["torch"])
    t_ort = statistics.median(times["onnxruntime"])
    tokens = batch * graph.node("embedder").cfg["seq_len"]
    flops = analyze(graph).flops_per_sample * batch
    ratio = paired_median(times["onnxruntime"], times["torch"])
    return {"passes": passes, "torch": t_torch, "ort": t_ort, "ratio": ratio, "flops": flops,
            "tokens": tokens, "err": err, "vnodes": len(graph), "onnx_nodes": len(model.graph.node)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=7, help="timed rounds per runtime (median reported)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--variants", default="unfused,fused",
                    help="unfused (as written) and/or fused (after fuse-heads,fuse-lm-head-ce)")
    args = ap.parse_args()
    specs = [VARIANTS[v.strip()] for v in args.variants.split(",")]
    rows = [measure(spec, args.batch, args.repeat, args.warmup) for spec in specs]
    import onnxruntime

    print(f"6-layer network, batch {args.batch}, float32 inference (logits + loss), "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, "
          f"{platform.machine()}, {datetime.date.today()}")
    print(f"| graph | VNodes | ONNX nodes | torch eager (ms) | onnxruntime (ms) | ratio ort/torch (paired) | "
          f"torch GFLOP/s | ort GFLOP/s | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        label = "unfused" if r["passes"] == "none" else f"fused ({r['passes']})"
        print(f"| {label} | {r['vnodes']} | {r['onnx_nodes']} | {r['torch'] * 1e3:.0f} | {r['ort'] * 1e3:.0f} | "
              f"{r['ratio']:.2f} | {r['flops'] / r['torch'] / 1e9:.1f} | {r['flops'] / r['ort'] / 1e9:.1f} | "
              f"{r['err']:.1e} |")
    print()
    print("onnxruntime / torch eager: " + "; ".join(
        f"{'unfused' if r['passes'] == 'none' else 'fused'} {r['ratio']:.2f}" for r in rows) + f" ({rounds_note(args.repeat)})")


if __name__ == "__main__":
    main()
