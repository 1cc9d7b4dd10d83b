"""placement.json's replica fields: the plan's R replicas priced by the step cost model.

The `partition` pass places replica 0 on the graph (node.meta["pnode"]) and
records the whole plan in graph.meta["placement"]: `replica_pnodes` (per
replica, its PNodes in stage order; row 0 names the PNodes of the graph's own
assignment) and `batch_shares`.  `with_replicas` adds to a placement report
(`partition_export.placement_report`), recomputed from scratch:

- `replicas`, `replica_pnodes`, `batch_shares`, `replica_assignments` (per
  replica, VNode -> PNode);
- `step_seconds` (predicted, all-reduce, control collectives and update included), `pipeline_seconds`,
  `allreduce_seconds`, `control_seconds`, `update_seconds`, `allreduce` (per stage group: PNodes, gradient bytes,
  bytes sent, seconds) and `bytes_per_step` (everything workers send in a
  step: boundary tensors, tied-weight syncs, ring all-reduce);
- with R > 1, `pnodes` gains every replica's PNodes priced at their replica's
  share, and `bottleneck_*`, `cut_bytes_per_step` cover all replicas; each
  PNode's `bytes_sent_per_step` (what its worker sends: see
  `CostModel.bytes_sent`) includes its share 2 (R - 1) / R of its stage
  group's ring all-reduce, so they sum to `bytes_per_step`.

A report of a graph without replica fields is one replica over the PNodes in
order of use: its legacy fields are left exactly as they were.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from vgraph.base.diagnostics import VGraphError
from vgraph.cost.costmodel import CostModel
from vgraph.cost.fleet import Fleet
from vgraph.cost.stepcost import replica_assignment, shares_by_speed, step_cost
from vgraph.cost.tasks import stage_loads
from vgraph.ir.graph import Graph

__all__ = ["with_replicas", "replica_layout", "format_plan", "rebalanced_shares", "step_prediction_gap",
           "PREDICTION_TOLERANCE"]


def replica_layout(graph: Graph, assignment: dict[str, str], batch: int) -> tuple[list[list[str]], list[int]]:
    """(replica_pnodes, batch_shares) of the graph's plan; one replica when the plan records none."""
    placed = graph.meta.get("placement") or {}
    rows = placed.get("replica_pnodes")
    shares = placed.get("batch_shares")
    used = list(dict.fromkeys(assignment[n.id] for n in graph.topo_order()))
    if not rows:
        return [used], [batch]
    rows = [list(r) for r in rows]
    if len(rows) == 1 and set(rows[0]) == set(used):  # one replica: the whole batch, whatever it is now
        return [used], [batch]
    if set(rows[0]) != set(used) or len(shares or ()) != len(rows) or sum(shares) != batch:
        raise VGraphError(f"the placement's replicas do not match the graph: replica 0 uses "
                          f"{', '.join(rows[0])}, the graph's VNodes are on {', '.join(used)}; batch shares "
                          f"{shares} for batch {batch} (run 'partition' again after changing the batch)")
    return rows, [int(x) for x in shares]


def with_replicas(report: dict[str, Any], graph: Graph, fleet: Fleet, cm: CostModel, pipeline: str = "1f1b", *,
                  sent: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """`report` (a placement report of replica 0 at the global batch) with the replica fields added; the
    pipeline priced as the workers run it under `pipeline` (1f1b or gpipe: vgraph/cost/schedule.py).
    `sent`: `cm.bytes_sent` of the report's assignment, which the report has priced already."""
    assign = report["assignment"]
    rows, shares = replica_layout(graph, assign, cm.batch)
    pnode_of = {p.id: p for p in fleet}
    unknown = sorted({p for row in rows for p in row} - set(pnode_of))
    if unknown:
        raise VGraphError(f"the placement's replicas use PNode(s) {', '.join(unknown)} that fleet "
                          f"{fleet.name!r} does not have")
    stage_of_pnode = {p: s for s, p in enumerate(rows[0])}
    stage_of = {v: stage_of_pnode[p] for v, p in assign.items()}
    loads = stage_loads(cm, stage_of, len(rows[0]))
    cost = step_cost(loads, [[pnode_of[p] for p in row] for row in rows], shares, cm.micro_batches, fleet,
                     pipeline)
    R = len(rows)
    out = dict(report)
    out.update({
        "replicas": R, "replica_pnodes": rows, "batch_shares": shares,
        "replica_assignments": [assign] + [replica_assignment(assign, rows, r) for r in range(1, R)],
        "step_seconds": cost.step_seconds, "pipeline_seconds": cost.pipeline_seconds, "pipeline": pipeline,
        "allreduce_seconds": cost.allreduce_seconds, "control_seconds": cost.control_seconds,
        "update_seconds": cost.update_seconds,
        "allreduce": [{"stage": s, "pnodes": [row[s] for row in rows], "grad_bytes": float(loads.grad_bytes[s]),
                       "bytes_per_step": float(cost.allreduce_bytes[s]),
                       "seconds": float(cost.allreduce_stage_seconds[s])} for s in range(len(rows[0]))],
        "allreduce_bytes_per_step": float(cost.allreduce_bytes.sum()),
        "grad_compress": cm.grad_compress.text(),  # grad_bytes: what a group all-reduces under it
    })
    if R == 1:
        out["bytes_per_step"] = float(report["cut_bytes_per_step"])
        return out
    pnodes = {pid: dict(info) for pid, info in report["pnodes"].items()}
    flops = loads.flops
    computed = cost.compute_seconds  # as the step was priced
    sent_by_stage = [sent.get(pid, (0, 0)) for pid in rows[0]]  # `sent` is by replica 0's PNodes: by stage
    for r, row in enumerate(rows):
        for s, pid in enumerate(row):
            p = pnode_of[pid]
            compute = computed[r, s]
            seconds = float(cost.stage_seconds[r, s])
            pnodes[pid] = {
                "vnodes": list(report["pnodes"][rows[0][s]]["vnodes"]), "replica": r, "stage": s,
                "batch_share": shares[r], "memory_bytes": int(cost.memory[r, s]), "capacity_bytes": p.memory,
                "flops_per_step": float(shares[r] * flops[s]),
                "boundary_bytes_per_step": float(shares[r] * loads.p2p[s].sum() + loads.sync[s].sum()),
                "bytes_sent_per_step": float(shares[r] * sent_by_stage[s][0] + sent_by_stage[s][1]
                                             + cost.allreduce_bytes[s] / R),  # a ring member's share
                "compute_seconds": float(compute), "comm_seconds": seconds - float(compute), "seconds": seconds,
                "fits": bool(cost.memory[r, s] <= p.memory)}
    out["cut_edges"] = [dict(e, bytes_per_step=e["bytes_per_step"] // cm.batch * shares[0])
                        for e in report["cut_edges"]]  # replica 0's, at its share
    bottleneck = max((pid for row in rows for pid in row), key=lambda pid: pnodes[pid]["seconds"])
    out.update({"pnodes": pnodes, "bottleneck_seconds": pnodes[bottleneck]["seconds"],
                "bottleneck_pnode": bottleneck, "cut_bytes_per_step": float(cost.p2p_bytes.sum()),
                "bytes_per_step": cost.bytes_per_step})
    return out


def format_plan(report: dict[str, Any], shown: int = 8) -> str:
    """The plan of a placement report in a few lines: replicas, shares, all-reduce, the predicted step."""
    from vgraph.cost.fleet import human_bytes

    R, rows, shares = report["replicas"], report["replica_pnodes"], report["batch_shares"]
    S = len(rows[0])
    used = sum(len(r) for r in rows)
    lines = [f"plan on fleet {report['fleet']!r} (batch {report['batch']}, {report['micro_batches']} micro-batch"
             f"{'es' * (report['micro_batches'] != 1)} per replica): {R} replica{'s' * (R != 1)} x {S} stage"
             f"{'s' * (S != 1)} on {used} PNodes"]
    for r, row in enumerate(rows[:shown]):
        seconds = max(report["pnodes"][p]["seconds"] for p in row)
        lines.append(f"  replica {r}: {' -> '.join(row)}, {shares[r]} sample{'s' * (shares[r] != 1)}, "
                     f"slowest stage {seconds:.4g} s")
    if R > shown:
        lines.append(f"  ... {R - shown} more replicas (shares {min(shares)}..{max(shares)})")
    if R > 1:
        for g in report["allreduce"][:shown]:
            lines.append(f"  all-reduce stage {g['stage']}: {human_bytes(g['grad_bytes'])} of gradients over "
                         f"{len(g['pnodes'])} PNodes, {human_bytes(g['bytes_per_step'])} sent, {g['seconds']:.4g} s")
    control = report.get("control_seconds") or 0.0
    update = report.get("update_seconds") or 0.0
    lines.append(f"predicted step {report['step_seconds']:.4g} s = pipeline {report['pipeline_seconds']:.4g} s + "
                 f"all-reduce {report['allreduce_seconds']:.4g} s"
                 + (f" + control collectives {control:.4g} s" if control else "")
                 + (f" + batch draw and optimizer step {update:.4g} s" if update else "")
                 + f"; {human_bytes(report['bytes_per_step'])} sent per step")
    single = (report.get("plan") or {}).get("pipeline_only_step_seconds")
    if single:
        lines.append(f"one pipeline over the fleet would take {single:.4g} s a step "
                     f"({single / report['step_seconds']:.2f}x this plan)")
    return "\n".join(lines)


def rebalanced_shares(graph: Graph, fleet: Fleet, assignment: dict[str, str], rows: list[list[str]], batch: int,
                      micro_batches: int) -> list[int]:
    """Batch shares for the replicas `rows` of the graph's stages (after a replica was lost, say): each
    replica's share in proportion to its speed, within its memory (`stepcost.shares_by_speed`)."""
    from vgraph.cost.costmodel import cost_model

    cm = cost_model(graph, batch=batch, micro_batches=micro_batches)
    stage_of_pnode = {p: s for s, p in enumerate(rows[0])}
    loads = stage_loads(cm, {v: stage_of_pnode[p] for v, p in assignment.items()}, len(rows[0]))
    return shares_by_speed(loads, fleet, rows, batch, micro_batches)


#: A predicted step more than this factor off the measured one (either way) is flagged (`vgraph report`,
#: `vgraph launch`): within it the plan's choices still hold; beyond it the fleet describes other machines
#: (a GPU fleet run on a CPU: 0.0034 s predicted against 3.77 s measured) and the placement is a guess.
PREDICTION_TOLERANCE = 2.0
_MIN_MEASURED_STEPS = 3  # the first step pays for warm-up: fewer measured steps say nothing yet


def step_prediction_gap(placement: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> str | None:
    """What to say when placement.json's predicted step is more than `PREDICTION_TOLERANCE` off the measured one,
    else None.  Measured: the median over the logged steps of the slowest PNode's step time (metrics rows'
    `pnodes`), the step as the pipeline and the replicas' all-reduce took it.  Both sides come from files a run
    wrote (the report reads any run): a value that is not a finite positive number means there is nothing to say."""
    predicted = placement.get("step_seconds", placement.get("bottleneck_seconds"))
    if not _positive(predicted):
        return None
    steps = []
    for row in rows:
        pnodes = row.get("pnodes") if isinstance(row, Mapping) else None
        times = [f.get("step_s") for f in pnodes.values() if isinstance(f, Mapping)] if isinstance(pnodes, Mapping) else []
        times = [t for t in times if _positive(t)]
        if times:
            steps.append(max(times))
    if len(steps) < _MIN_MEASURED_STEPS:
        return None
    measured = statistics.median(steps)
    ratio = measured / predicted
    if 1 / PREDICTION_TOLERANCE <= ratio <= PREDICTION_TOLERANCE:
        return None
    how = f"{ratio:,.0f}x slower" if ratio >= 10 else f"{ratio:.1f}x slower" if ratio > 1 else (
        f"{1 / ratio:,.1f}x faster")
    return (f"the step took {measured:.3g} s (median of {len(steps)}) against {predicted:.3g} s predicted, {how}: "
            f"the fleet's figures do not describe the machines that ran it, so the placement was chosen on wrong "
            f"numbers. Measure each machine with `vgraph probe NETWORK --id PNODE --bandwidth BW --append FLEET` "
            f"(README: A fleet from probes) and partition or launch again.")


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
