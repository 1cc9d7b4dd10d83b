"""Where a launch's VNodes run: the pass pipeline cut around the partition pass, the placed graph every
worker builds (`Placement`), and the plan after a shrink.

Apart from the attempt loop because it is the one piece of the launcher that is plain graph work: tests,
benchmarks and `--emit-job` use it without starting anything, and it takes values (a graph, a fleet, the
pipelines), never the launch's settings.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vgraph.base.diagnostics import VGraphError
from vgraph.cost.costmodel import cost_model
from vgraph.cost.fleet import Fleet
from vgraph.cost.stepcost import shares_by_speed
from vgraph.cost.tasks import stage_loads
from vgraph.ir.graph import Graph
from vgraph.placement.export import assignment_of, placement_report
from vgraph.placement.replica_report import rebalanced_shares
from vgraph.run.compiled_graph import NO_FUSE_PIPELINE, PLAN_CHOICES, apply_assignment
from vgraph.transform.pipeline import DEFAULT_PIPELINE, Pipeline, available_passes, run_pipeline

from ...training.config import TrainingError

__all__ = ["Placement", "split_pipeline", "place", "led_by", "shrink"]


def split_pipeline(passes: str | None, fuse: bool, options: dict[str, str]) -> tuple[Pipeline, Pipeline, Pipeline]:
    """(passes before the partition, the partition pass, passes after it) for a `vgraph train` pipeline.

    The partition goes right after dead-nodes/precision (it prices effective
    precisions) and before any fusion (fusion then respects the placement);
    a pipeline that names `partition` itself keeps its place and options,
    with the run's batch and micro-batches.
    """
    if passes is not None and not fuse:
        raise VGraphError(f"give either --passes or --no-fuse, not both (--no-fuse means the pipeline "
                          f"'{NO_FUSE_PIPELINE}')")
    options = {**options, "replicas": options.get("replicas", "1")}  # one pipeline unless the run asks for more
    pipeline = Pipeline.parse(passes) if passes is not None else (DEFAULT_PIPELINE if fuse else NO_FUSE_PIPELINE)
    if "partition" not in pipeline:  # after the last of dead-nodes/precision, else first
        pipeline = pipeline.insert("partition", after=("dead-nodes", "precision"), before=pipeline.names)
    before, partition, after = pipeline.with_options("partition", **options).split("partition")
    return before, Pipeline((partition,)), after


@dataclass
class Placement:
    graph: Graph  # placed and optimised, as every worker builds it
    assignment: dict[str, str]  # VNode -> PNode right after the partition pass (pre-fusion ids)
    final: dict[str, str]  # VNode -> PNode of `graph`
    ranks: list[str]  # rank -> PNode, in order of use along the network (replica 0: the plan's ranks)
    report: dict[str, Any]  # placement_report (placement.json)
    rows: list[list[str]] = field(default_factory=list)  # per replica, its PNodes in stage order
    shares: list[int] = field(default_factory=list)  # per replica, its samples of the global batch
    choices: dict[str, Any] = field(default_factory=dict)  # the partition's choices the passes after it read
    # The network as the partition pass saw and assigned it (after the passes before it, before any fusion):
    # the VNodes `assignment` names, whose state a re-plan moves (vgraph/placement/replan.state_bytes).
    assigned: Graph | None = None

    @property
    def world(self) -> list[str]:
        """World rank -> PNode: replica r's workers are ranks r*P .. r*P+P-1, in the plan's rank order."""
        stage = {p: s for s, p in enumerate(self.rows[0])}
        return [row[stage[p]] for row in self.rows for p in self.ranks]


def place(source: Graph, fleet: Fleet, *, before: str | Pipeline, partition: str | Pipeline, after: str | Pipeline,
          target: str, batch: int,
          micro_batches: int, assignment: dict[str, str] | None = None,
          replicas: tuple[list[list[str]], list[int]] | None = None, grad_compress: str = "none",
          pipeline: str = "1f1b", choices: dict[str, Any] | None = None) -> Placement:
    """Partition `source` onto `fleet` (or take `assignment`) and build the placed graph the workers build.

    A given `assignment` names the VNodes as the partition pass would see them (after the passes before it,
    i.e. before any fusion); `replicas` (rows of PNodes per replica, batch shares) goes with it when the run
    has replicas, and `choices` the partition's choices it was made with (a re-placed plan).  Shares None:
    dealt here by speed, as for the partition pass's plans (a plan whose PNodes changed: `led_by`)."""
    graph = source.copy()
    if before:
        run_pipeline(graph, before, target=target)
    planned_here = assignment is None
    if assignment is None:
        if "partition" not in available_passes():
            raise VGraphError("the 'partition' pass is not installed: reinstall vgraph (pip install -e .) so "
                              "its entry point is registered")
        run_pipeline(graph, partition, target=target, data={"fleet": fleet})
        assignment = {n.id: n.meta["pnode"] for n in graph.nodes}
        planned = graph.meta.get("placement") or {}
        if planned.get("replicas", 1) > 1:
            replicas = (planned["replica_pnodes"], planned["batch_shares"])
        choices = {k: planned[k] for k in PLAN_CHOICES if k in planned}
    else:
        missing = [n.id for n in graph.nodes if n.id not in assignment]
        unknown = sorted(set(assignment.values()) - set(fleet.ids))
        problems = []
        if missing:
            problems.append(f"does not place VNode(s) {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        if unknown:
            problems.append(f"names PNode(s) {', '.join(unknown)} that fleet {fleet.name!r} does not have")
        if problems:
            raise VGraphError(f"the given placement {'; '.join(problems)}")
        assignment = {n.id: assignment[n.id] for n in graph.nodes}
        choices = dict(choices or {})
    placed = apply_assignment(source, before, assignment, after, target, choices)
    final = assignment_of(placed)
    cm = cost_model(placed, batch=batch, micro_batches=micro_batches, grad_compress=grad_compress)  # one, for all
    stage = {p: s for s, p in enumerate(replicas[0][0])} if replicas is not None else {}  # replica 0's, in order
    cut = (stage_loads(cm, {v: stage[p] for v, p in final.items()}, len(stage))
           if stage and set(final.values()) <= stage.keys() else None)  # else a layout the report refuses
    if cut is not None and (planned_here or replicas[1] is None):
        # The partition pass balanced the shares before the fusions, counting per-VNode overheads on every VNode
        # they merge, where the workers run one fused op (issue 42); they are balanced on the graph that runs.
        try:
            shares = shares_by_speed(cut, fleet, replicas[0], batch, micro_batches)
        except VGraphError:
            # The placed graph's memory count cannot hold the batch in these rows (a fleet sized to the pass's
            # count, which fits: tests/test_distributed_replicas.py): the pass's shares, as before; rows given
            # without shares (led_by's) have none to fall back on.
            if replicas[1] is None:
                raise
            shares = replicas[1]
        replicas = (replicas[0], shares)
    ranks = list(dict.fromkeys(final[n.id] for n in placed.topo_order()))
    placed.meta["placement"] = {"batch": batch, "micro_batches": micro_batches, "grad_compress": grad_compress,
                                "pipeline": pipeline, **choices}  # the schedule the step is priced as
    if replicas is not None:
        placed.meta["placement"].update(replica_pnodes=replicas[0], batch_shares=replicas[1])
    report = placement_report(placed, fleet, batch=batch, micro_batches=micro_batches, cm=cm)
    return Placement(placed, assignment, final, ranks, report, report["replica_pnodes"], report["batch_shares"],
                     choices, graph)


def led_by(placement: Placement, fleet: Fleet, leads: set[str]
           ) -> tuple[dict[str, str], tuple[list[list[str]], list[int]] | None] | None:
    """The plan as (assignment, replica layout) with world rank 0 on one of `leads`, or None when it is there.

    Why: rank 0 serves the attempt's store on the master's address and writes the run (metrics, checkpoints)
    where the coordinator keeps it, so across machines it must run on a PNode of the coordinator's machine,
    and the partition pass prices plans, not machines.  The same plan with the replicas in another order costs
    the same, so a replica whose rank-0 stage is a lead goes first; else the lead PNode takes rank 0's place
    and rank 0's PNode the lead's (unused: dropped), with no shares: `place` deals them by speed.  The caller
    places the result, which prices it as it will run (a swap between PNodes of unequal figures changes the
    step and the shares)."""
    stage = {p: s for s, p in enumerate(placement.rows[0])}
    first = stage[placement.ranks[0]]  # world rank 0 is replica 0's PNode at this stage
    rows, shares = placement.rows, placement.shares
    if rows[0][first] in leads:
        return None
    ahead = next((r for r, row in enumerate(rows) if row[first] in leads), None)
    if ahead is not None:
        order = [ahead] + [r for r in range(len(rows)) if r != ahead]
        rows, shares = [rows[r] for r in order], [shares[r] for r in order]
    else:
        lead = min(p for p in leads if p in fleet.ids)
        swap = {rows[0][first]: lead, lead: rows[0][first]}
        rows, shares = [[swap.get(p, p) for p in row] for row in rows], None
    assignment = {v: rows[0][stage[p]] for v, p in placement.assignment.items()}
    return assignment, ((rows, shares) if len(rows) > 1 else None)


def shrink(placement: Placement, fleet: Fleet, lost: list[str], described: str, batch: int, micro: int
            ) -> tuple[dict[str, str], tuple[list[list[str]], list[int]]]:
    """The plan without the replicas that lost a worker: the survivors keep their PNodes, replica 0's
    assignment moves to the first survivor, and the global batch is shared out again by speed.  A replica with
    a PNode `fleet` lacks goes too: the next attempt cannot place it (an elastic run's machine that said it
    leaves: a restart is its boundary, and the replica it held must not be priced on a fleet without it)."""
    rows = [row for row in placement.rows if not set(row) & set(lost) and set(row) <= set(fleet.ids)]
    if not rows:
        raise TrainingError(f"worker {described} failed and no complete replica is left (--on-failure shrink "
                            f"drops the replicas that lost a worker, and those of machines that leave)")
    stage = {p: s for s, p in enumerate(placement.rows[0])}
    assignment = {v: rows[0][stage[p]] for v, p in placement.assignment.items()}
    final = {v: rows[0][stage[p]] for v, p in placement.final.items()}
    shares = rebalanced_shares(placement.graph, fleet, final, rows, batch, micro)
    return assignment, (rows, shares)
