"""One pipeline over a fleet: the `Plan` (an assignment of units to PNodes with its numbers),
`plan_partition` (solve without touching the graph) and `apply_plan` (write it into the graph).

Its own module so that the replica planner (`partition_replicas`, which plans one pipeline per replica) and
the pass (`partition`, which may apply either kind of plan) both import it and not each other.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from vgraph.base.diagnostics import Diagnostic
from vgraph.base.gcpause import paused_gc
from vgraph.cost.costmodel import DEFAULT_BATCH, CostModel, cost_model
from vgraph.cost.fleet import Fleet, resolve_fleet
from vgraph.ir.graph import Graph

from vgraph.passes.partition_problem import Evaluation, PartitionError, Problem, better, build_problem, evaluate, infeasible
from vgraph.passes.partition_solve import solve

__all__ = ["Plan", "apply_plan", "plan_partition"]


@dataclass
class Plan:
    problem: Problem
    assign: np.ndarray  # unit -> PNode index
    method: str
    evaluation: Evaluation = field(init=False)

    def __post_init__(self) -> None:
        self.evaluation = evaluate(self.problem, self.assign)

    def pnode_of(self, node_id: str) -> str:
        return self.problem.pnodes[int(self.assign[self.problem.unit_of[node_id]])].id

    def summary(self, graph: Graph, cm: CostModel, fleet: Fleet) -> dict:
        """graph.meta["placement"]: the plan in numbers (JSON-compatible)."""
        ev, pr = self.evaluation, self.problem
        counts = Counter(self.assign.tolist())
        along = []  # the PNodes in order of use along the unit chain (one the chain comes back to, again)
        for u in range(pr.n):
            pid = pr.pnodes[int(self.assign[u])].id
            if not along or along[-1] != pid:
                along.append(pid)
        pnodes = {}
        for i, p in enumerate(pr.pnodes):
            pnodes[p.id] = {
                "units": counts.get(i, 0),
                "vnodes": int(sum(len(pr.units[u].members) for u in np.flatnonzero(self.assign == i))),
                "memory_bytes": int(ev.memory[i]), "capacity_bytes": int(p.memory),
                "flops_per_step": float(ev.compute[i]), "boundary_bytes_per_step": float(ev.boundary[i]),
                "compute_seconds": float(ev.compute[i] / p.flops),
                "comm_seconds": float(ev.boundary[i] / p.bandwidth), "seconds": float(ev.times[i])}
        sync = []
        for t in cm.ties:
            a, b = self.pnode_of(t.publisher), self.pnode_of(t.user)
            if a != b:
                sync.append({"alias": t.alias, "publisher": t.publisher, "user": t.user, "from_pnode": a,
                             "to_pnode": b, "bytes_per_step": t.sync_bytes_per_step})
        return {
            "fleet": fleet.name, "batch": pr.batch, "micro_batches": pr.micro_batches, "view": pr.view,
            "units": pr.n, "method": self.method, "stages": along,
            "bottleneck_seconds": ev.bottleneck,
            "bottleneck_pnode": pr.pnodes[int(np.argmax(ev.times))].id,
            "cut_bytes_per_step": ev.cut, "pnodes": pnodes, "weight_sync": sync,
        }


def plan_partition(graph: Graph, fleet: Fleet | str, *, batch: int = DEFAULT_BATCH, micro_batches: int = 1,
                   cm: CostModel | None = None) -> tuple[Plan, CostModel]:
    """Solve the placement of `graph` on `fleet` without touching the graph."""
    fleet = resolve_fleet(fleet)
    with paused_gc():
        return _plan(graph, fleet, batch, micro_batches, cm)


def _plan(graph: Graph, fleet: Fleet, batch: int, micro_batches: int, cm: CostModel | None
          ) -> tuple[Plan, CostModel]:
    cm = cm or cost_model(graph, batch=batch, micro_batches=micro_batches)
    problem = build_problem(graph, fleet, batch=batch, micro_batches=micro_batches, cm=cm)
    try:
        assign, method = solve(problem)
    except PartitionError as exc:  # point at the unit's first VNode in the user's file
        if exc.unit is None:
            raise
        first = graph.node(problem.units[exc.unit].members[0])
        raise PartitionError([Diagnostic(str(exc), first.loc, first.id)]) from None
    plan = Plan(problem, assign, method)
    if not plan.evaluation.feasible:  # never: every step keeps memory; but never silently either
        raise infeasible(problem)
    if problem.view == "vnodes":  # keeping preferred groups whole is as good or better: prefer it
        coarse = build_problem(graph, fleet, batch=batch, micro_batches=micro_batches, cm=cm, view="groups")
        try:
            c_assign, c_method = solve(coarse)
        except PartitionError:
            c_assign = None
        if c_assign is not None:
            expanded = np.array([c_assign[coarse.unit_of[m]] for u in problem.units for m in u.members[:1]])
            candidate = Plan(problem, expanded, c_method + "+groups")
            if not better(plan.evaluation.key(), candidate.evaluation.key(), 1e-6):
                plan = candidate
    return plan, cm


def apply_plan(graph: Graph, plan: Plan, cm: CostModel, fleet: Fleet) -> int:
    """Write node.meta["pnode"] and graph.meta["placement"]; returns how many VNodes changed PNode."""
    pr = plan.problem
    ids = [p.id for p in pr.pnodes]
    changed = 0
    for u, unit in enumerate(pr.units):
        pid = ids[int(plan.assign[u])]
        for nid in unit.members:
            meta = graph.node(nid).meta
            if meta.get("pnode") != pid:
                meta["pnode"] = pid
                changed += 1
    graph.meta["placement"] = plan.summary(graph, cm, fleet)
    return changed
