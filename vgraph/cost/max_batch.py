"""The largest batch each PNode of a plan can train, with and without rematerialisation.

Why: "what batch fits" is the first question about a new network on a fleet,
and at long context the answer is decided by activations, which remat trades
for FLOPs.  For each PNode of a placement (VNode -> PNode, see the partition
pass), with the cost model of vgraph/cost/costmodel.py:

    static + per_sample x resident(batch) <= the PNode's memory

where static is what the PNode holds whatever the batch (weights, gradients,
optimizer state, tied-weight replicas), resident(batch) the samples whose
activations it keeps at once (1F1B: ceil(batch / M) x min(M, stages)), and
per_sample is

* without remat: every activation kept (the graph's own marks ignored);
* with remat: the least vgraph/cost/remat.py's model allows, every candidate of
  every group recomputed (kept bytes plus the largest group's rebuilt bytes),
  which is what the remat pass falls back to when the batch needs it.
"""
from __future__ import annotations

from math import ceil
from typing import Mapping

from vgraph.cost.costmodel import CostModel
from vgraph.cost.fleet import Fleet
from vgraph.cost.remat import candidates, closed, plain_activation, pnode_static_bytes, remat_cost, remat_layout
from vgraph.ir.graph import Graph

__all__ = ["max_batch_report", "largest_batch", "format_max_batch"]

LIMIT = 2**40  # "any batch": the search stops here


def _resident(batch: int, micro_batches: int, stages: int) -> int:
    return ceil(batch / micro_batches) * max(1, min(micro_batches, stages))


def largest_batch(capacity: int, static: int, per_sample: int, micro_batches: int = 1, stages: int = 1) -> int:
    """The largest batch with static + per_sample x resident(batch) <= capacity (0: not even one sample)."""
    room = capacity - static
    if room < 0 or per_sample * _resident(1, micro_batches, stages) > room:
        return 0
    if per_sample <= 0:
        return LIMIT
    lo, hi = 1, 2
    while per_sample * _resident(hi, micro_batches, stages) <= room:  # hi doubles until it does not fit
        if hi >= LIMIT:
            return LIMIT
        lo, hi = hi, min(hi * 2, LIMIT)
    while hi - lo > 1:  # resident() is monotone in the batch
        mid = (lo + hi) // 2
        if per_sample * _resident(mid, micro_batches, stages) <= room:
            lo = mid
        else:
            hi = mid
    return lo


def max_batch_report(graph: Graph, cm: CostModel, fleet: Fleet, pnode_of: Mapping[str, str],
                     micro_batches: int = 1, stages: int = 1) -> dict:
    """Per PNode of the placement `pnode_of`: bytes and the largest batch, with and without remat."""
    act = plain_activation(cm)
    flops = dict(zip(cm.node_columns["id"], cm.node_columns["flops"]))
    rows = []
    for p in fleet:
        ids = [nid for nid, pid in pnode_of.items() if pid == p.id]
        if not ids:
            continue
        static = pnode_static_bytes(cm, ids, pnode_of, p.id)
        keep_all = sum(act[nid] for nid in ids)
        cands = candidates(graph, cm, ids, pnode_of)
        marks = closed(graph, [c for cs in cands.values() for c in cs])
        least = remat_cost(remat_layout(graph, marks), act, flops, ids)
        rows.append({
            "pnode": p.id, "memory_bytes": p.memory, "static_bytes": static, "vnodes": len(ids),
            "activation_bytes_per_sample": keep_all,
            "max_batch": largest_batch(p.memory, static, keep_all, micro_batches, stages),
            "remat_activation_bytes_per_sample": least.peak_bytes,
            "remat_recompute_flops_per_sample": least.recompute_flops,
            "max_batch_remat": largest_batch(p.memory, static, least.peak_bytes, micro_batches, stages),
        })
    return {"network": graph.name, "fleet": fleet.name, "micro_batches": micro_batches, "stages": stages,
            "max_batch": min(r["max_batch"] for r in rows), "max_batch_remat": min(r["max_batch_remat"] for r in rows),
            "pnodes": rows}


def format_max_batch(report: dict) -> str:
    from vgraph.cost.fleet import human_bytes

    rows = [("pnode", "memory", "weights+optimizer", "act/sample", "max batch", "act/sample (remat)",
             "max batch (remat)")]
    for r in report["pnodes"]:
        rows.append((r["pnode"], human_bytes(r["memory_bytes"]), human_bytes(r["static_bytes"]),
                     human_bytes(r["activation_bytes_per_sample"]), str(r["max_batch"]),
                     human_bytes(r["remat_activation_bytes_per_sample"]), str(r["max_batch_remat"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"network {report['network']!r} on fleet {report['fleet']!r} ({report['stages']} stage(s), "
             f"{report['micro_batches']} micro-batch(es)): the largest batch each PNode fits"]
    for k, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append(f"the plan fits batch {report['max_batch']} without remat, {report['max_batch_remat']} with remat")
    return "\n".join(lines)
