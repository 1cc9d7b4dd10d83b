"""The exact oracle for the `remat` pass: the same choice as an ILP (PuLP + CBC), for small graphs.

Tests and benchmarks/bench_remat.py compare the pass's recompute FLOPs with
this optimum; the pass never calls it.

Per candidate v (passes/remat.py `candidates`) a binary x_v (recompute); a
broadcast takes its input's x (its outputs alias the input).  A VNode runs
again in backward when it is marked or reads a marked VNode (r_v >= x_v,
r_v >= x_u for each edge u -> v), as vgraph/cost/remat.py's regions do.  Kept bytes
are sum act_v (1 - x_v); t >= the marked bytes of each group (backward
rebuilds one group's region at a time).  Minimise sum flops_v r_v subject to
kept + t <= the bytes per sample the scope allows.
"""
from __future__ import annotations

import warnings

from vgraph.cost.costmodel import CostModel
from vgraph.ir.graph import Graph

from vgraph.passes.remat import RematScope, candidates, closed, plain_activation


def solve_remat_ilp(graph: Graph, cm: CostModel, scope: RematScope, where=None, *, time_limit: float = 60.0
                    ) -> tuple[frozenset[str] | None, float, str]:
    """(marks, optimal recompute FLOPs per sample, solver status); marks None when nothing fits."""
    import pulp

    where = where if where is not None else {n.id: n.meta.get("pnode") for n in graph.nodes}
    act = plain_activation(cm)
    flops = dict(zip(cm.node_columns["id"], cm.node_columns["flops"]))
    cands = candidates(graph, cm, scope.ids, where)
    flat = [c for cs in cands.values() for c in cs]
    with warnings.catch_warnings():  # PuLP 3.x announces its 4.0 API on every variable
        warnings.simplefilter("ignore", DeprecationWarning)
        lp = pulp.LpProblem("remat", pulp.LpMinimize)
        x = {v: pulp.LpVariable(f"x_{i}", cat="Binary") for i, v in enumerate(flat)}
        mark = dict(x)  # broadcasts follow their input
        for node in graph.topo_order():
            if node.type == "broadcast":
                e = graph.input_edge(node.id, 0)
                if e is not None and e.src in mark:
                    mark[node.id] = mark[e.src]
        runs = set()
        for v in mark:
            runs.add(v)
            runs.update(e.dst for e in graph.out_edges(v))
        r = {v: pulp.LpVariable(f"r_{i}", lowBound=0, upBound=1) for i, v in enumerate(sorted(runs))}
        t = pulp.LpVariable("t", lowBound=0)
        scale = max(1.0, float(max(act.values(), default=1)))
        lp += pulp.lpSum(flops[v] / 1e9 * r[v] for v in r)
        for v in r:
            if v in mark:
                lp += r[v] >= mark[v]
            for e in graph.in_edges(v):
                if e.src in mark:
                    lp += r[v] >= mark[e.src]
        for g, cs in cands.items():
            lp += t >= pulp.lpSum(act[v] / scale * x[v] for v in cs)
        kept = pulp.lpSum(act[v] / scale for v in scope.ids) - pulp.lpSum(act[v] / scale * x[v] for v in flat)
        lp += kept + t <= scope.per_sample / scale
        status = lp.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit))
        name = pulp.LpStatus[status]
        if name != "Optimal":
            return None, float("inf"), name
        marks = closed(graph, [v for v in flat if (x[v].value() or 0) > 0.5])
        total = sum(flops[v] for v in r if any(round(mark[u].value() or 0) for u in _sources(graph, v, mark)))
        return marks, float(total), name


def _sources(graph: Graph, v: str, mark: dict) -> list[str]:
    out = [v] if v in mark else []
    out += [e.src for e in graph.in_edges(v) if e.src in mark]
    return out
