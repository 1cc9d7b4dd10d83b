"""Partition pass: speed, quality against the exact ILP, cut bytes against METIS.

Targets (issue 6): under 10 ms for the 8-layer network, under 2 s for a generated
100k-VNode network; objective (bottleneck seconds) within 5% of the ILP optimum on
every small instance (<= 60 VNodes, <= 4 PNodes).

    .venv/bin/python benchmarks/bench_partition.py [--repeat 7] [--no-100k] [--ilp-limit 60]

`ilp_instances()` is also the test set of tests/test_partition.py.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from tools.gen_networks import TransformerSpec, transformer  # noqa: E402
from vgraph import load  # noqa: E402
from vgraph.cost.fleet import Fleet, PNode, load_fleet  # noqa: E402
from vgraph.ir.graph import Graph  # noqa: E402

NET8 = ROOT / "networks" / "distributed_attention_example_8_swiglu_head_vocab32768_seq512.yml"
FLEETS = ROOT / "networks" / "fleets"


def tiny(layers: int, heads: int = 2, groups: str = "required") -> Graph:
    """A tiny transformer (dim 32, seq 16, vocab 96); groups: required | preferred | none."""
    g = transformer(TransformerSpec(f"tiny-{layers}l-{heads}h-{groups}", layers=layers, vocab=96, seq_len=16,
                                    dim=32, heads=heads, ffn=128, head_up=64))
    if groups != "required":
        for n in g.nodes:
            if groups == "preferred":
                n.set_config(colocate_policy=None)
            else:
                n.set_config(colocate_policy=None, colocate_group=None)
    return g


def fleet(name: str, *specs: tuple[float, float, float]) -> Fleet:
    """PNodes from (memory bytes, FLOP/s, bandwidth bytes/s) triples."""
    return Fleet.of(name, *(PNode(f"{name}-{i}", int(m), f, bw) for i, (m, f, bw) in enumerate(specs)))


# CBC proves these in well under a second or a few seconds each (tests/test_partition.py runs
# them); the others take 3-30 s each and run in this benchmark only.
QUICK = ("2l-req/2 equal", "2l-req/3 hetero", "3l-req/4 equal", "3l-req/4 hetero", "3l-req/3 tight memory",
         "3l-req/2 slow network", "2l-pref/4 hetero", "1l-none/2 tight memory")


def ilp_instances(quick: bool = False) -> list[tuple[str, Graph, Fleet, int]]:
    """(name, graph, fleet, batch): tiny transformers on 2-4 PNode fleets, <= 60 VNodes.

    Block compute at batch 8 is ~1.1e7 FLOPs, an inter-block edge ~16-64 KB and a
    block ~350 KB of memory, so FLOP/s ~1e9 and bandwidth ~1e7 B/s make compute and
    traffic compete, and memory limits below a few blocks force splits.
    """
    big = 1 << 30
    out = [
        ("2l-req/2 equal", tiny(2), fleet("eq2", (big, 1e9, 1e7), (big, 1e9, 1e7)), 8),
        ("2l-req/3 hetero", tiny(2), fleet("het3", (big, 2e9, 1e7), (big, 1e9, 2e7), (big, 5e8, 1e7)), 8),
        ("3l-req/4 equal", tiny(3), fleet("eq4", *[(big, 1e9, 5e7)] * 4), 8),
        ("3l-req/4 hetero", tiny(3), fleet("het4", (big, 4e9, 1e7), (big, 1e9, 1e7), (big, 1e9, 4e7),
                                           (big, 2e9, 2e7)), 8),
        ("3l-req/3 tight memory", tiny(3), fleet("mem3", (8e5, 1e9, 1e7), (8e5, 1e9, 1e7), (8e5, 2e9, 1e7)), 8),
        ("3l-req/2 slow network", tiny(3), fleet("slow2", (big, 1e9, 1e5), (big, 1e9, 1e5)), 8),
        ("1l-pref-4h/3 heads spread", tiny(1, heads=4, groups="preferred"),
         fleet("spread3", (big, 2e8, 1e9), (big, 1e8, 1e9), (big, 1e8, 5e8)), 8),
        ("1l-pref-2h/3 heads spread", tiny(1, heads=2, groups="preferred"),
         fleet("spread3b", (big, 2e8, 1e9), (big, 1e8, 1e9), (big, 1e8, 5e8)), 8),
        ("2l-pref/4 hetero", tiny(2, groups="preferred"),
         fleet("phet4", (big, 1e9, 2e8), (big, 5e8, 2e8), (big, 5e8, 1e8), (big, 2e9, 1e8)), 8),
        ("1l-none/3 equal", tiny(1, groups="none"), fleet("none3", *[(big, 1e8, 1e8)] * 3), 8),
        ("1l-none/2 tight memory", tiny(1, groups="none"), fleet("nmem2", (3.5e5, 1e9, 1e7), (3.5e5, 1e9, 1e7)), 8),
    ]
    for name, g, _, _ in out:
        assert len(g) <= 60, (name, len(g))
    return [case for case in out if case[0] in QUICK] if quick else out


# -- measurements ------------------------------------------------------------------------------

def pass_seconds(graph: Graph, fleet_: Fleet, repeat: int, batch: int = 8) -> tuple[float, dict]:
    from vgraph.passes.partition import Partition
    from vgraph.transform.pass_api import PassContext

    # One pipeline: the table's targets are the pipeline planner's; bench_fleet_scale.py times replicas=auto.
    p = Partition(batch=batch, replicas="1")
    p.run(graph.copy(), PassContext(data={"fleet": fleet_}))  # warm-up (imports, caches)
    times, cpu = [], []
    placement: dict = {}
    for _ in range(repeat):
        g = graph.copy()
        gc.collect()
        start, start_cpu = time.perf_counter(), time.process_time()
        p.run(g, PassContext(data={"fleet": fleet_}))
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        placement = g.meta["placement"]
    return statistics.median(times), statistics.median(cpu), placement


def metis_parts(problem, nparts: int) -> np.ndarray:
    """pymetis on the same unit graph: vertex weight = compute, edge weight = bytes per step."""
    import pymetis

    n = problem.n
    adj: list[dict[int, float]] = [dict() for _ in range(n)]
    for p, q, w in zip(problem.edge_p.tolist(), problem.edge_q.tolist(), problem.edge_w.tolist()):
        adj[p][q] = adj[p].get(q, 0) + w
        adj[q][p] = adj[q].get(p, 0) + w
    wscale = max(1.0, max((w for a in adj for w in a.values()), default=1.0) / 1e6)
    vscale = max(1.0, float(problem.compute.max()) / 1e6)
    xadj, adjncy, eweights = [0], [], []
    for a in adj:
        for v, w in sorted(a.items()):
            adjncy.append(v)
            eweights.append(max(1, int(round(w / wscale))))
        xadj.append(len(adjncy))
    vweights = [max(1, int(round(c / vscale))) for c in problem.compute.tolist()]
    adjacency = pymetis.CSRAdjacency(xadj, adjncy) if hasattr(pymetis, "CSRAdjacency") else None
    if adjacency is not None:
        _, membership = pymetis.part_graph(nparts, adjacency, vweights=vweights, eweights=eweights)
    else:
        _, membership = pymetis.part_graph(nparts, xadj=xadj, adjncy=adjncy, vweights=vweights,
                                           eweights=eweights)
    return np.array(membership, dtype=np.int64)


def metis_vs_ours(graph: Graph, fleet_: Fleet, batch: int = 8) -> dict:
    """Both on the same units; METIS parts are matched to PNodes by the bottleneck assignment."""
    from vgraph.passes.partition import evaluate, plan_partition
    from vgraph.passes.partition_solve import bottleneck_order

    plan, _ = plan_partition(graph, fleet_, batch=batch)
    pr = plan.problem
    used = len(set(plan.assign.tolist()))
    nparts = max(2, used)
    t0 = time.perf_counter()
    parts = metis_parts(pr, nparts)
    metis_s = time.perf_counter() - t0
    # METIS part ids -> PNodes: give the parts to PNodes so the slowest is as fast as possible
    order = list(range(pr.k))
    relabel = np.array(order, dtype=np.int64)[parts]
    better_order = bottleneck_order(pr, relabel, order)
    stages = [p for p in order if np.any(relabel == p)]
    mapping = {old: new for old, new in zip(stages, better_order)}
    mapped = np.array([mapping[int(p)] for p in relabel], dtype=np.int64)
    ev = evaluate(pr, mapped)
    return {"parts": nparts, "ours_bottleneck": plan.evaluation.bottleneck, "ours_cut": plan.evaluation.cut,
            "metis_bottleneck": ev.bottleneck, "metis_cut": ev.cut, "metis_feasible": ev.feasible,
            "metis_seconds": metis_s}


def ilp_table(limit: float) -> list[tuple]:
    from vgraph.passes.partition import plan_partition
    from vgraph.passes.partition_ilp import solve_ilp

    rows = []
    for name, g, fl, batch in ilp_instances():
        t0 = time.perf_counter()
        plan, _ = plan_partition(g, fl, batch=batch)
        ours_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        _, z, cut, status = solve_ilp(plan.problem, time_limit=limit)
        ilp_s = time.perf_counter() - t0
        ev = plan.evaluation
        gap = (ev.bottleneck - z) / z * 100 if z > 0 else 0.0
        rows.append((name, len(g), plan.problem.n, plan.problem.k, ev.bottleneck, z, gap, ev.cut, cut,
                     ours_s, ilp_s, plan.method))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--no-100k", action="store_true")
    ap.add_argument("--ilp-limit", type=float, default=60.0, help="CBC time limit per solve (s)")
    ap.add_argument("--only", default="time,ilp,metis", help="sections to run (comma separated)")
    args = ap.parse_args()
    sections = set(args.only.split(","))

    if "time" in sections:
        import os

        print("## Pass time (Partition.run: cost model + plan + annotations; median wall and CPU time; "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
        print(f"{'network':<28}{'fleet':<10}{'VNodes':>8}{'units':>7}{'wall':>12}{'CPU':>12}{'bottleneck s':>14}"
              f"{'cut MB/step':>13}  method")
    net8 = load(NET8)
    cases = [("8-layer production", net8, fl) for fl in ("t4x4", "mixed16")]
    if not args.no_100k:
        from tools.gen_networks import synthetic

        big = synthetic(100_000)
        cases += [("synthetic 100k", big, fl) for fl in ("t4x4", "mixed16")]
    for name, g, fl_name in cases if "time" in sections else []:
        fl = load_fleet(FLEETS / f"{fl_name}.yml")
        repeat = args.repeat if len(g) < 10_000 else 3
        t, c, pl = pass_seconds(g, fl, repeat)
        print(f"{name:<28}{fl_name:<10}{len(g):>8}{pl['units']:>7}{t * 1e3:>9.2f} ms{c * 1e3:>9.2f} ms"
              f"{pl['bottleneck_seconds']:>14.5g}{pl['cut_bytes_per_step'] / 1e6:>13.3f}  {pl['method']}")

    if "ilp" in sections:
        ilp_section(args.ilp_limit)
    if "metis" in sections:
        metis_section(cases)


def ilp_section(limit: float) -> None:
    print()
    print("## Objective vs the exact ILP (PuLP/CBC), batch 8: bottleneck seconds, then cut bytes")
    head = (f"{'instance':<24}{'VNodes':>7}{'units':>6}{'PN':>4}{'ours s':>12}{'ILP s':>12}{'gap':>8}"
            f"{'ours cut':>10}{'ILP cut':>10}{'ours t':>9}{'ILP t':>9}  method")
    print(head)
    worst = 0.0
    for (name, nv, nu, k, ours, z, gap, cut, icut, ts, ti, method) in ilp_table(limit):
        worst = max(worst, gap)
        print(f"{name:<24}{nv:>7}{nu:>6}{k:>4}{ours:>12.5g}{z:>12.5g}{gap:>7.2f}%{cut / 1e3:>9.1f}k"
              f"{icut / 1e3:>9.1f}k{ts * 1e3:>7.1f}ms{ti:>8.2f}s  {method}")
    print(f"worst gap: {worst:.2f}% (target: <= 5%)")


def metis_section(cases: list) -> None:
    print()
    print("## Cut bytes vs METIS (pymetis, same units, parts = PNodes our plan uses; "
          "METIS parts matched to PNodes by bottleneck assignment)")
    print(f"{'network':<28}{'fleet':<9}{'parts':>6}{'ours cut MB':>13}{'METIS cut MB':>14}"
          f"{'ours bottleneck':>17}{'METIS bottleneck':>18}")
    mcases = [(name, g, fl) for name, g, fl in cases]
    wanted = ("3l-req/4 equal", "3l-req/4 hetero", "2l-pref/4 hetero", "1l-none/3 equal", "1l-pref-4h/3 heads spread")
    mcases += [(name, g, fl) for name, g, fl, _ in ilp_instances() if name in wanted]
    for name, g, fl in mcases:
        fl_obj = fl if isinstance(fl, Fleet) else load_fleet(FLEETS / f"{fl}.yml")
        r = metis_vs_ours(g, fl_obj)
        feas = "" if r["metis_feasible"] else " (over memory)"
        print(f"{name:<28}{fl_obj.name:<9}{r['parts']:>6}{r['ours_cut'] / 1e6:>13.3f}{r['metis_cut'] / 1e6:>14.3f}"
              f"{r['ours_bottleneck']:>17.5g}{r['metis_bottleneck']:>18.5g}{feas}")


if __name__ == "__main__":
    main()
