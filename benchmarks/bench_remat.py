"""Rematerialisation: what batch fits, how close the policy is to optimal, what a CPU step measures.

Three tables (issue 14's goals), each side by side in one run:

1. **max batch** of the network on one 16 GiB T4-class PNode (networks/fleets/t4x1.yml), without and
   with remat, from the cost model (`vgraph analyze --max-batch`);
2. **policy vs ILP**: recompute FLOPs the `remat` pass's policy chooses and the exact ILP optimum
   (passes/remat_ilp.py) on the tiny networks, fused and unfused, at several budgets;
3. **a measured CPU step** (float32, Adam) without and with remat: the tensor peak of one training
   step, each variant in a process of its own, forked (every storage any aten op allocates, followed until
   freed, as benchmarks/bench_memory.py measures), with `estimate_training_memory`'s activations + workspace
   beside it; and the step time, both variants built in one process and their steps alternated after
   a warm-up each (median of --steps per variant, wall and process CPU time), so that the load of a
   shared machine falls on both alike.  The remat
   variant runs the production pipeline plus `remat{budget=B,batch=N}` with B the least memory the
   cost model allows (every candidate recomputed), so the policy picks the cheapest marks at that peak.

    .venv/bin/python benchmarks/bench_remat.py [--network 12|8|tiny] [--batch 1] [--steps 2] [--threads 2]
    .venv/bin/python benchmarks/bench_remat.py --smoke      # tiny network, one step: seconds
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rounds import paired_median, rotated, rounds_note  # noqa: E402

NETWORKS = {
    "12": ROOT / "networks" / "distributed_attention_example_12_swiglu_head_vocab32768_seq2048.yml",
    "8": ROOT / "networks" / "distributed_attention_example_8_swiglu_head_vocab32768_seq512.yml",
    "tiny": ROOT / "tests" / "fixtures" / "tiny_2l.yml",
}
T4X1 = ROOT / "networks" / "fleets" / "t4x1.yml"
MIB = 2**20


def remat_spec(network: str, batch: int) -> str:
    """The production pipeline plus remat at the least memory the cost model allows (see the docstring)."""
    import vgraph
    from vgraph.backends.torch import prepare_graph
    from vgraph.cost.costmodel import cost_model
    from vgraph.cost.remat import candidates, closed, plain_activation, pnode_static_bytes, remat_cost, remat_layout

    graph = prepare_graph(vgraph.load(NETWORKS[network]), target="cpu")
    cm = cost_model(graph, batch=batch)
    ids = list(cm.node_columns["id"])
    marks = closed(graph, [c for cs in candidates(graph, cm, ids, {}).values() for c in cs])
    flops = dict(zip(ids, cm.node_columns["flops"]))
    least = remat_cost(remat_layout(graph, marks), plain_activation(cm), flops, ids)
    budget = pnode_static_bytes(cm, ids, {}, None) + least.peak_bytes * cm.resident_samples()
    return f"dead-nodes,precision,fuse-heads,fuse-lm-head-ce,remat{{budget={budget},batch={batch}}}"


def child(network: str, passes: str | None, batch: int, threads: int) -> dict:
    """The tensor peak of one step of one variant (after a warm-up step)."""
    import torch

    from vgraph.backends.torch.training.peak_memory import LiveTensorBytes
    from vgraph.backends.torch import estimate_training_memory
    from vgraph.cost.remat import marked_ids

    torch.set_num_threads(threads)
    graph, step, vocab, seq = _trainer(network, passes, batch)
    first_loss = step()  # warm-up: Adam's moments are allocated here
    gc.collect()
    tracker = LiveTensorBytes(vocab=vocab)  # the step's allocations above what existed before it
    with tracker:
        step()
    estimate = estimate_training_memory(graph, batch)
    return {"vnodes": len(graph), "marked": len(marked_ids(graph)), "loss": first_loss,
            "tensor_peak": tracker.peak, "estimate_step": estimate.activations + estimate.workspace, "seq": seq,
            "torch": torch.__version__}


def time_child(network: str, specs: list[str | None], batch: int, threads: int, steps: int) -> list[dict]:
    """Step times of the variants `specs`, built side by side and alternated step by step."""
    import torch

    torch.set_num_threads(threads)
    trainers = [_trainer(network, spec, batch)[1] for spec in specs]
    for step in trainers:
        step()  # warm-up
    wall: list[list[float]] = [[] for _ in specs]
    cpu: list[list[float]] = [[] for _ in specs]
    for r in range(steps):
        for i, step in rotated(list(enumerate(trainers)), r):
            gc.collect()
            w0, c0 = time.perf_counter(), time.process_time()
            step()
            wall[i].append(time.perf_counter() - w0)
            cpu[i].append(time.process_time() - c0)
    return [{"wall": w, "cpu": c} for w, c in zip(wall, cpu)]


def _trainer(network: str, passes: str | None, batch: int):
    """(graph, one training step as vgraph train runs it, vocabulary, sequence length) of a variant."""
    from train_step_fixture import training_step

    graph, _, _, step, vocab, seq = training_step(NETWORKS[network], passes, batch, keyed_dropout=True)
    return graph, step, vocab, seq


def max_batch_rows(network: str) -> dict:
    import vgraph
    from vgraph.cost.costmodel import cost_model
    from vgraph.cost.fleet import load_fleet
    from vgraph.cost.max_batch import max_batch_report

    graph = vgraph.load(NETWORKS[network])
    fleet = load_fleet(T4X1)
    cm = cost_model(graph, batch=1)
    return max_batch_report(graph, cm, fleet, {n.id: fleet.ids[0] for n in graph.nodes})


def gap_rows(fractions: list[float]) -> list[tuple]:
    import vgraph
    from vgraph.cost.costmodel import cost_model
    from vgraph.cost.remat import plain_activation, remat_cost, remat_layout
    from vgraph.passes.remat import RematScope, plan_scope, scopes_of
    from vgraph.passes.remat_ilp import solve_remat_ilp
    from vgraph.transform.pipeline import run_pipeline

    rows = []
    for label, passes in (("tiny unfused", "dead-nodes,precision"),
                          ("tiny fused", "dead-nodes,precision,fuse-heads,fuse-lm-head-ce")):
        graph = vgraph.load(NETWORKS["tiny"])
        run_pipeline(graph, passes, target="cpu")
        cm = cost_model(graph, batch=4)
        base = scopes_of(graph, cm, 10**15, None)[0]
        act = plain_activation(cm)
        flops = dict(zip(cm.node_columns["id"], cm.node_columns["flops"]))
        where = {n.id: None for n in graph.nodes}
        for frac in fractions:
            scope = RematScope("bench", base.ids, base.static_bytes + int(sum(act.values()) * frac) * base.resident,
                               base.static_bytes, base.resident)
            t0 = time.perf_counter()
            marks, chosen, _ = plan_scope(graph, cm, scope, where)
            t_policy = time.perf_counter() - t0
            t0 = time.perf_counter()
            _, optimum, status = solve_remat_ilp(graph, cm, scope, where)
            t_ilp = time.perf_counter() - t0
            policy = remat_cost(remat_layout(graph, marks), act, flops, base.ids).recompute_flops if chosen else None
            rows.append((label, frac, len(marks), policy, optimum, status, t_policy, t_ilp))
    return rows


def _in_fork(fn, *args):
    """fn(*args) in a forked child: a process of its own for each measurement, with torch already imported
    by this one (a fresh interpreter paid 3-4 CPU-s of imports per child, most of the smoke setting's time).
    The result comes back as JSON; None (its traceback on stderr) where the child failed."""
    import multiprocessing as mp
    import traceback

    def run(conn) -> None:
        try:
            conn.send(json.dumps(fn(*args)))
        except BaseException:  # noqa: BLE001 - any failure is the parent's to report
            traceback.print_exc()
            conn.send(None)
        finally:
            conn.close()

    ctx = mp.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=run, args=(send,))
    proc.start()
    send.close()
    try:
        answer = receive.recv()
    except EOFError:  # the child died before answering (killed, out of memory)
        answer = None
    proc.join()
    return None if answer is None or proc.exitcode != 0 else json.loads(answer)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--network", choices=sorted(NETWORKS), default="12")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per variant (median)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fractions", default="0.95,0.85,0.75,0.65", help="ILP table: budgets as activation fractions")
    ap.add_argument("--smoke", action="store_true", help="tiny network, one timed step, two budgets")
    args = ap.parse_args(argv)
    if args.smoke:
        args.network, args.steps, args.threads, args.fractions = "tiny", 1, 1, "0.9,0.7"

    print(f"### Rematerialisation ({datetime.date.today().isoformat()}, {platform.machine()} {os.cpu_count()}-core "
          f"CPU)\n")
    print(f"Command: `.venv/bin/python benchmarks/bench_remat.py {' '.join(argv or sys.argv[1:])}`".rstrip() + "\n")

    mb = max_batch_rows("12" if not args.smoke else "tiny")
    print(f"**Max batch on one 16 GiB T4-class PNode** ({mb['network']}, cost model, `vgraph analyze --fleet "
          f"networks/fleets/t4x1.yml --max-batch`)\n")
    print("| PNode | weights + optimizer (MiB) | activations/sample (MiB) | max_batch | with remat (MiB/sample) | "
          "max_batch_remat | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in mb["pnodes"]:
        ratio = r["max_batch_remat"] / r["max_batch"] if r["max_batch"] else float("inf")
        print(f"| {r['pnode']} | {r['static_bytes'] / MIB:.0f} | {r['activation_bytes_per_sample'] / MIB:.1f} | "
              f"{r['max_batch']} | {r['remat_activation_bytes_per_sample'] / MIB:.1f} | {r['max_batch_remat']} | "
              f"{ratio:.2f}x |")

    print("\n**Policy vs the exact ILP** (recompute FLOPs per sample; budget = weights + a fraction of the "
          "activations, batch 4)\n")
    print("| network | budget fraction | VNodes marked | policy FLOPs | ILP optimum | gap | policy s | ILP s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, frac, n, policy, optimum, status, tp, ti in gap_rows([float(f) for f in args.fractions.split(",")]):
        gap = "-" if policy is None or status != "Optimal" else f"{(policy - optimum) / max(optimum, 1):+.1%}"
        print(f"| {label} | {frac} | {n} | {policy if policy is not None else 'no fit'} | "
              f"{optimum if status == 'Optimal' else status} | {gap} | {tp:.3f} | {ti:.3f} |")

    variants = {"without remat": None, "with remat": remat_spec(args.network, args.batch)}
    import torch  # noqa: F401 - imported once here, before the children fork

    rows = {}
    for label, passes in variants.items():
        rows[label] = _in_fork(child, args.network, passes, args.batch, args.threads)
        if rows[label] is None:
            return 1
        print(f"measured {label}", file=sys.stderr)
    times = _in_fork(time_child, args.network, list(variants.values()), args.batch, args.threads, args.steps)
    if times is None:
        return 1
    for label, t in zip(variants, times):
        rows[label]["step_s"] = statistics.median(t["wall"])
        rows[label]["cpu_s"] = statistics.median(t["cpu"])
        rows[label]["times"] = t
    base, remat = rows["without remat"], rows["with remat"]
    print(f"\n**Measured CPU training step** ({NETWORKS[args.network].stem}, batch {args.batch} x {base['seq']}, "
          f"float32, Adam, torch {base['torch']}, {args.threads} threads; peaks: one forked process per variant; "
          f"times: both variants in one process, steps alternated, median of {args.steps} each; the ratios below "
          f"are medians of the rounds' own ratios)\n")
    print("| variant | VNodes | marked | tensor peak of the step (MiB) | estimate (MiB) | estimate / peak | "
          "step wall (s) | step CPU (s) | first loss |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, r in rows.items():
        print(f"| {label} | {r['vnodes']} | {r['marked']} | {r['tensor_peak'] / MIB:.0f} | "
              f"{r['estimate_step'] / MIB:.0f} | {r['estimate_step'] / r['tensor_peak']:.2f} | {r['step_s']:.2f} | "
              f"{r['cpu_s']:.2f} | {r['loss']:.6f} |")
    wall = paired_median(remat["times"]["wall"], base["times"]["wall"])
    cpu = paired_median(remat["times"]["cpu"], base["times"]["cpu"])
    print(f"\nWith remat the step's tensor peak is {1 - remat['tensor_peak'] / base['tensor_peak']:.1%} lower and the "
          f"step takes {wall:.2f}x the wall time ({cpu:.2f}x the CPU time; {rounds_note(args.steps)}).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
