"""Toward internet scale, by simulation: what pipeline x replicas buys on fleets of 10 to 1,000 PNodes.

    python benchmarks/bench_fleet_scale.py [--sizes 10,20,50,100,200,500,1000] [--seeds 3] [--generations 60]
        [--plot fleet_scale.png]

Four tables, the first three on the cost model (`vgraph/cost/stepcost.py`), nothing trained:

1. Predicted tokens/s of the 8-layer production network (seq 512, global
   batch 1,024 sequences, 8 micro-batches per replica) on heterogeneous
   fleets from tools/gen_fleet.py (seed 0), one pipeline (the `partition`
   pass as before, `--replicas 1`) against pipeline x replicas (`auto`), with
   the planning time of each.
2. On the largest fleet: the best predicted step for each replica count R,
   split into pipeline and all-reduce: where adding replicas stops paying
   (the all-reduce over ever slower links costs more than the compute saved).
3. A geo-distributed fleet built from published measurements: 64 V100-class
   PNodes, 8 in each of the 8 AWS regions of Yuan et al., "Decentralized
   Training of Foundation Models in Heterogeneous Environments" (NeurIPS
   2022), with the inter-region bandwidth and latency they measured
   (Oregon-Virginia 67 ms / 0.79 Gbit/s ... Sydney-London 262 ms / 0.326 Gbit/s;
   inside a region 10 ms / 2 Gbit/s; values in tools/gen_fleet.py, published
   with the paper's code, DS3Lab/DT-FM scheduler/generate_sim_com_matrices.py).
   The planner against an evolutionary search over allocations in their manner
   (benchmarks/evolutionary_allocation.py) on the same cost model, for every
   stage cut with all 64 PNodes in use (their setting) and for the planner's
   own layout; 3 seeds each.

4. The partition pass's own time with `replicas=1` and `auto`, side by side
   (`--with-100k` adds the generated 100k-VNode network).

The plot (two panels): tokens/s against fleet size for both, and step time
against R on the largest fleet with the point where all-reduce stops paying.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.evolutionary_allocation import evolve  # noqa: E402
from benchmarks.rounds import paired_median, rotated, rounds_note  # noqa: E402
from tools.gen_fleet import WORLD_CITIES, heterogeneous, world_links  # noqa: E402
from vgraph.cost.costmodel import cost_model  # noqa: E402
from vgraph.cost.fleet import Fleet, PNode  # noqa: E402
from vgraph.cost.stepcost import FleetArrays  # noqa: E402
from vgraph.passes.partition_replicas import candidates, plan_replicas  # noqa: E402
from vgraph.yamlio import load  # noqa: E402

NET8 = ROOT / "networks" / "distributed_attention_example_8_swiglu_head_vocab32768_seq512.yml"
NET12 = ROOT / "networks" / "distributed_attention_example_12_swiglu_head_vocab32768_seq2048.yml"
BATCH, MICRO = 1024, 8


def scaling(sizes: list[int]) -> list[dict]:
    graph = load(NET8)
    seq = int(graph.node("embedder").cfg["seq_len"])
    rows = []
    print("## 1. Predicted tokens/s against fleet size (8-layer network, batch 1,024 x 512 tokens, M = 8)\n")
    print("| PNodes | one pipeline: stages | tokens/s | planning s wall / CPU | pipeline x replicas: R x S (PNodes) | "
          "tokens/s | all-reduce share of step | planning s wall / CPU | speed-up |")
    print("|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for n in sizes:
        fleet = heterogeneous(n, seed=0)
        t, c = time.perf_counter(), time.process_time()
        one, _ = plan_replicas(graph, fleet, batch=BATCH, micro_batches=MICRO, replicas=1)
        t_one, c_one = time.perf_counter() - t, time.process_time() - c
        t, c = time.perf_counter(), time.process_time()
        auto, _ = plan_replicas(graph, fleet, batch=BATCH, micro_batches=MICRO)
        t_auto, c_auto = time.perf_counter() - t, time.process_time() - c
        tok_one = BATCH * seq / one.cost.step_seconds
        tok_auto = BATCH * seq / auto.cost.step_seconds
        share = auto.cost.allreduce_seconds / auto.cost.step_seconds
        rows.append(dict(n=n, one=tok_one, auto=tok_auto, R=auto.replicas, S=auto.stages))
        print(f"| {n} | {one.stages} | {tok_one:,.0f} | {t_one:.2f} / {c_one:.2f} | {auto.replicas} x {auto.stages} "
              f"({auto.replicas * auto.stages}) | {tok_auto:,.0f} | {share:.0%} | {t_auto:.2f} / {c_auto:.2f} | "
              f"{tok_auto / tok_one:.1f}x |")
    return rows


def where_allreduce_stops_paying(n: int) -> list[dict]:
    graph = load(NET8)
    fleet = heterogeneous(n, seed=0)
    cm = cost_model(graph, batch=BATCH, micro_batches=MICRO)
    fa = FleetArrays(fleet)
    best: dict[int, object] = {}
    for cand in candidates(graph, fleet, cm, fa, BATCH, MICRO):
        if cand is not None and (cand.replicas not in best or
                                 cand.cost.step_seconds < best[cand.replicas].cost.step_seconds):
            best[cand.replicas] = cand
    rs = sorted(best)
    top = min(rs, key=lambda r: best[r].cost.step_seconds)
    print(f"\n## 2. Best predicted step by replica count on {n} PNodes (before the planner's swap search)\n")
    print("| R | S | step s | pipeline s | all-reduce s | |")
    print("|---:|---:|---:|---:|---:|---|")
    shown = sorted({r for r in rs if r <= 8 or r == top or r == rs[-1] or r in (12, 16, 24, 32, 48, 64, 96, 128,
                                                                                   192, 256, 384, 512, 768)})
    out = []
    for r in rs:
        c = best[r].cost
        out.append(dict(R=r, step=c.step_seconds, pipe=c.pipeline_seconds, ar=c.allreduce_seconds))
    for r in shown:
        c, mark = best[r].cost, ("<- fastest: more replicas no longer pay for their all-reduce" if r == top else "")
        print(f"| {r} | {best[r].stages} | {c.step_seconds:.4f} | {c.pipeline_seconds:.4f} | "
              f"{c.allreduce_seconds:.4f} | {mark} |")
    return out


def geo_fleet() -> Fleet:
    """64 V100-class PNodes (16 GiB, 40 TFLOP/s sustained fp16, 10 Gbit/s NICs), 8 per region."""
    pnodes = [PNode(f"v100-{city.lower()}-{i}", 16 * 2 ** 30, 40e12, 10e9 / 8, "cuda-sm70", None, city)
              for city in WORLD_CITIES for i in range(8)]
    return Fleet.of("world64", *pnodes, links=world_links())


def geo(seeds: int = 3, generations: int = 60) -> None:
    graph = load(NET12)
    fleet = geo_fleet()
    batch, micro = 256, 8
    cm = cost_model(graph, batch=batch, micro_batches=micro)
    fa = FleetArrays(fleet)
    t = time.perf_counter()
    plan, _ = plan_replicas(graph, fleet, batch=batch, micro_batches=micro, cm=cm)
    t_plan = time.perf_counter() - t
    seq = int(graph.node("embedder").cfg["seq_len"])
    print(f"\n## 3. Geo-distributed: 64 V100-class PNodes in 8 AWS regions (Yuan et al.'s measured links), "
          f"12-layer network (seq 2,048), batch {batch}, M = {micro}\n")
    print(f"planner: {plan.replicas} x {plan.stages} ({plan.method}), predicted step {plan.cost.step_seconds:.3f} s "
          f"(pipeline {plan.cost.pipeline_seconds:.3f} + all-reduce {plan.cost.allreduce_seconds:.3f}), "
          f"{batch * seq / plan.cost.step_seconds:,.0f} tokens/s, planned in {t_plan:.2f} s\n")
    print("| layout searched by evolution | seeds | best step s | mean step s | evaluations/run | "
          "planner's step / best evolved |")
    print("|---|---:|---:|---:|---:|---:|")
    layouts = {}
    for cand in candidates(graph, fleet, cm, fa, batch, micro):
        if cand is not None and cand.replicas * cand.stages == len(fleet) and cand.stages not in layouts:
            layouts[cand.stages] = (cand.loads, cand.replicas)  # all 64 PNodes in use, as in their setting
    layouts.setdefault(plan.stages, (plan.loads, plan.replicas))
    key_plan = (plan.stages, plan.replicas)
    runs = [(S, loads, R) for S, (loads, R) in sorted(layouts.items())]
    if key_plan not in {(S, R) for S, _, R in runs}:
        runs.append((plan.stages, plan.loads, plan.replicas))
    best_evolved = math.inf
    for S, loads, R in runs:
        results = [evolve(loads, fa, R, batch, micro, generations=generations, seed=s) for s in range(seeds)]
        steps = [r.step_seconds for r in results]
        best_evolved = min(best_evolved, min(steps))
        mean = sum(steps) / len(steps)
        print(f"| {R} x {S}{' (the planner’s)' if (S, R) == key_plan else ''} | {seeds} | {min(steps):.3f} | "
              f"{mean:.3f} | {results[0].evaluations} | {plan.cost.step_seconds / min(steps):.3f} |")
    verdict = "same or better" if plan.cost.step_seconds <= best_evolved * (1 + 1e-9) else "WORSE"
    print(f"\nplanner {plan.cost.step_seconds:.3f} s vs best evolved {best_evolved:.3f} s: {verdict}")


def pass_time(with_100k: bool, repeat: int = 3) -> None:
    """The partition pass with --replicas 1 (one pipeline, the pass before issue 17) and auto, side by side."""
    import statistics

    from tools.gen_networks import synthetic
    from vgraph.cost.fleet import load_fleet
    from vgraph.passes.partition import Partition
    from vgraph.transform.pass_api import PassContext

    cases = [("8-layer production", load(NET8))]
    if with_100k:
        cases.append(("synthetic 100k", synthetic(100_000)))
    print("\n## 4. Partition pass time (Partition.run, batch 8, median), one pipeline vs auto, alternated\n")
    print("| network | fleet | replicas=1 | auto | auto / replicas=1 time (median of rounds) | auto plan | "
          "auto step / one pipeline's |")
    print("|---|---|---:|---:|---:|---|---:|")
    for name, graph in cases:
        rounds = repeat if len(graph) < 10_000 else 1
        for fl in ("t4x4", "mixed16"):
            fleet = load_fleet(ROOT / "networks" / "fleets" / f"{fl}.yml")
            times: dict[str, list[float]] = {"1": [], "auto": []}
            placed = {}
            for r in range(rounds):
                for rep in rotated(list(times), r):
                    g = graph.copy()
                    t = time.perf_counter()
                    Partition(batch=8, replicas=rep).run(g, PassContext(data={"fleet": fleet}))
                    times[rep].append(time.perf_counter() - t)
                    placed[rep] = g.meta["placement"]
            a = placed["auto"]
            print(f"| {name} | {fl} | {statistics.median(times['1']) * 1e3:.1f} ms | "
                  f"{statistics.median(times['auto']) * 1e3:.1f} ms | "
                  f"{paired_median(times['auto'], times['1']):.2f} ({rounds_note(rounds)}) | "
                  f"{a['replicas']} x {a['stages_per_replica']} | "
                  f"{a['step_seconds'] / placed['1']['step_seconds']:.2f} |")


def plot(rows: list[dict], curve: list[dict], n: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    sizes = [r["n"] for r in rows]
    a.plot(sizes, [r["one"] for r in rows], "o-", label="one pipeline")
    a.plot(sizes, [r["auto"] for r in rows], "s-", label="pipeline x replicas (auto)")
    for r in rows:
        a.annotate(f"{r['R']}x{r['S']}", (r["n"], r["auto"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel("PNodes in the fleet")
    a.set_ylabel("predicted tokens/s")
    a.set_title("8-layer network, batch 1,024 x 512 tokens")
    a.legend()
    rs = [c["R"] for c in curve]
    b.plot(rs, [c["step"] for c in curve], "k-", label="step")
    b.plot(rs, [c["pipe"] for c in curve], "--", label="pipeline (compute + p2p)")
    b.plot(rs, [c["ar"] for c in curve], ":", label="gradient all-reduce")
    top = min(curve, key=lambda c: c["step"])
    b.axvline(top["R"], color="grey", alpha=0.5)
    b.annotate(f"all-reduce stops paying: R = {top['R']}", (top["R"], top["step"]), textcoords="offset points",
               xytext=(6, 20), fontsize=8)
    b.set_xscale("log")
    b.set_yscale("log")
    b.set_xlabel("replicas R")
    b.set_ylabel("predicted step (s)")
    b.set_title(f"best plan per R on {n} heterogeneous PNodes")
    b.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)
    print(f"\nplot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10,20,50,100,200,500,1000")
    ap.add_argument("--plot", default=str(ROOT / "benchmarks" / "fleet_scale.png"))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--generations", type=int, default=60,
                    help="generations of each evolutionary search in table 3 (default 60; the smoke test runs 1)")
    ap.add_argument("--with-100k", action="store_true", help="also time the pass on a 100k-VNode network")
    args = ap.parse_args()
    if args.seeds < 1 or args.generations < 1:
        ap.error(f"--seeds and --generations must be at least 1, got {args.seeds} and {args.generations}")
    sizes = [int(x) for x in args.sizes.split(",")]
    rows = scaling(sizes)
    curve = where_allreduce_stops_paying(sizes[-1])
    geo(args.seeds, args.generations)
    pass_time(args.with_100k)
    if args.plot:
        plot(rows, curve, sizes[-1], Path(args.plot))


if __name__ == "__main__":
    main()
