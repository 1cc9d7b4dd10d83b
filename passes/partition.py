"""partition: assign every VNode to a PNode of a fleet (node.meta["pnode"]).

The pass in three modules, by job:

* `partition_problem`: the problem (units, costs, the objective) and `evaluate`;
* `partition_solve`: the heuristic that solves it (`solve`);
* this module: the `Plan` (an assignment with its numbers), `plan_partition`,
  `apply_plan` and the `Partition` pass.

`partition_ilp` holds the exact oracle the tests and benchmarks compare with.
Every number lands in graph.meta["placement"] (see `Plan.summary`).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from vgraph.costmodel import DEFAULT_BATCH, CostModel, cost_model
from vgraph.diagnostics import Diagnostic
from vgraph.fleet import Fleet, human_bytes, resolve_fleet
from vgraph.gcpause import paused_gc
from vgraph.ir import Graph
from vgraph.pass_api import Option, Pass, PassContext, PassError
from vgraph.remat import RECOMPUTE, candidates, closed, marked_ids

from .partition_problem import (Evaluation, PartitionError, Problem, Unit, better, build_problem, evaluate,
                                infeasible)
from .partition_solve import solve

__all__ = ["Evaluation", "Partition", "PartitionError", "Plan", "Problem", "Unit", "apply_plan", "better",
           "build_problem", "evaluate", "plan_partition", "solve"]


# -- the plan ------------------------------------------------------------------------------------

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
        stages = []
        for u in range(pr.n):
            pid = pr.pnodes[int(self.assign[u])].id
            if not stages or stages[-1] != pid:
                stages.append(pid)
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
            "units": pr.n, "method": self.method, "stages": stages,
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


class Partition(Pass):
    """Place VNodes on a fleet's PNodes: required groups whole, memory fits, min bottleneck then cut."""

    name = "partition"
    preserves_semantics = True  # placement annotations only
    after = ("dead-nodes", "precision")
    options = {
        "fleet": Option(str, None, "fleet spec file (default: the caller's ctx.data['fleet'])"),
        "batch": Option(int, DEFAULT_BATCH, "samples per training step"),
        "micro_batches": Option(int, 1, "micro-batches per step (1F1B pipeline: bounds resident activations)"),
        "replicas": Option(str, "auto", "data-parallel replicas of the pipeline: a number, or auto (the plan of "
                                        "least predicted step time, see partition_replicas.py)"),
        "remat": Option(str, "auto", "auto: when no plan fits the memory, plan again with every remat candidate "
                                     "recomputed (vgraph/remat.py) and say so; off: never", choices=("auto", "off")),
    }

    def run(self, graph: Graph, ctx: PassContext) -> Counter:
        fleet_spec = self.opts["fleet"] or ctx.data.get("fleet")
        if fleet_spec is None:
            raise PassError("pass 'partition' needs a fleet: give partition{fleet=FILE} or --fleet FILE")
        batch, micro = self.opts["batch"], self.opts["micro_batches"]
        if batch < 1 or micro < 1:
            raise PassError(f"pass 'partition': batch and micro_batches must be >= 1, got {batch}, {micro}")
        from .partition_replicas import apply_replica_plan, parse_replicas, plan_replicas

        try:
            replicas = parse_replicas(self.opts["replicas"])
        except ValueError as exc:
            raise PassError(f"pass 'partition': {exc}") from None
        fleet = resolve_fleet(fleet_spec)
        try:
            with paused_gc():
                rplan, cm = plan_replicas(graph, fleet, batch=batch, micro_batches=micro, replicas=replicas)
        except PartitionError as exc:
            if self.opts["remat"] == "off" or marked_ids(graph):
                raise
            rplan, cm = self._plan_with_remat(graph, fleet, batch, micro, replicas, exc, ctx)
        if rplan.base is not None:  # one pipeline over the fleet: the pass's own plan, as before
            changed = apply_plan(graph, rplan.base, cm, fleet)
            graph.meta["placement"].update(rplan.summary())
            ev = rplan.base.evaluation
            where = f"{len(set(rplan.base.assign.tolist()))} of {len(fleet)} PNodes"
        else:
            changed = apply_replica_plan(graph, rplan, cm, fleet)
            ev = None
            where = (f"{rplan.replicas} replica{'s' * (rplan.replicas != 1)} x {rplan.stages} stage"
                     f"{'s' * (rplan.stages != 1)} ({rplan.replicas * rplan.stages} of "
                     f"{len(fleet)} PNodes, batch shares {rplan.shares})")
        placed = graph.meta["placement"]
        ctx.notes.append(f"partition: {len(graph)} VNodes on {where} of {fleet.name!r}, predicted step "
                         f"{rplan.cost.step_seconds:.4g} s (all-reduce {rplan.cost.allreduce_seconds:.4g} s), "
                         f"bottleneck {placed['bottleneck_seconds']:.4g} s ('{placed['bottleneck_pnode']}'), "
                         f"{human_bytes(ev.cut if ev else placed['cut_bytes_per_step'])} cut per step")
        return Counter(placed=changed)

    @staticmethod
    def _plan_with_remat(graph: Graph, fleet, batch: int, micro: int, replicas, without: PartitionError,
                         ctx: PassContext):
        """No plan fits as the network keeps every activation: mark every remat candidate and plan again."""
        from .partition_replicas import plan_replicas

        cm = cost_model(graph, batch=batch, micro_batches=micro)
        ids = list(cm.node_columns["id"])
        marks = closed(graph, [c for cs in candidates(graph, cm, ids, {}).values() for c in cs])
        if not marks:
            raise without
        for nid in marks:
            graph.node(nid).set_config(remat=RECOMPUTE)
        try:
            with paused_gc():
                planned = plan_replicas(graph, fleet, batch=batch, micro_batches=micro, replicas=replicas)
        except PartitionError:
            for nid in marks:
                graph.node(nid).set_config(remat=None)
            raise without from None
        ctx.notes.append(f"partition: no plan keeps every activation at batch {batch} ({without}); with {len(marks)} "
                         f"VNodes recomputed in backward (remat: every candidate) it fits; add the remat pass after "
                         f"partition to recompute only what each PNode needs")
        return planned

