"""partition: assign every VNode to a PNode of a fleet (node.meta["pnode"]).

The pass in three modules, by job:

* `partition_problem`: the problem (units, costs, the objective) and `evaluate`;
* `partition_solve`: the heuristic that solves it (`solve`);
* `partition_plan`: one pipeline's `Plan` (an assignment with its numbers),
  `plan_partition` and `apply_plan`;
* `partition_replicas`: R replicas of an S-stage pipeline;
* `partition_compress`: the same with cut edges priced compressed (`compress=auto`)
  and the replicas' gradients all-reduced as `grad_compress` says;
* this module: the `Partition` pass, which picks and applies a plan.

`partition_ilp` holds the exact oracle the tests and benchmarks compare with.
Every number lands in graph.meta["placement"] (see `Plan.summary`).
"""
from __future__ import annotations

from collections import Counter

from vgraph.base.gcpause import paused_gc
from vgraph.base.options import MAX_BATCH
from vgraph.cost.costmodel import DEFAULT_BATCH, cost_model
from vgraph.cost.fleet import human_bytes, resolve_fleet
from vgraph.cost.remat import RECOMPUTE, candidates, closed, marked_ids
from vgraph.ir.graph import Graph
from vgraph.transform.pass_api import Option, Pass, PassContext, PassError

from vgraph.cost.grad_compression import parse_grad_compress

from vgraph.passes.partition_compress import describe_choice, plan_compressed
from vgraph.passes.partition_plan import Plan, apply_plan, plan_partition
from vgraph.passes.partition_problem import Evaluation, PartitionError, Problem, Unit, better, build_problem, evaluate
from vgraph.passes.partition_replicas import apply_replica_plan, parse_replicas
from vgraph.passes.partition_solve import solve

__all__ = ["Evaluation", "Partition", "PartitionError", "Plan", "Problem", "Unit", "apply_plan", "better",
           "build_problem", "evaluate", "plan_partition", "solve"]


class Partition(Pass):
    """Place VNodes on a fleet's PNodes: required groups whole, memory fits, min bottleneck then cut."""

    name = "partition"
    preserves_semantics = True  # placement annotations only
    after = ("dead-nodes", "precision")
    options = {
        "fleet": Option(str, None, "fleet spec file (default: the caller's ctx.data['fleet'])", names_file=True),
        "batch": Option(int, DEFAULT_BATCH, "samples per training step", min=1, max=MAX_BATCH),
        "micro_batches": Option(int, 1, "micro-batches per step (1F1B pipeline: bounds resident activations)",
                                min=1, max=MAX_BATCH),
        "replicas": Option(str, "auto", "data-parallel replicas of the pipeline: a number, or auto (the plan of "
                                        "least predicted step time, see partition_replicas.py)"),
        "remat": Option(str, "auto", "auto: when no plan fits the memory, plan again with every remat candidate "
                                     "recomputed (vgraph/cost/remat.py) and say so; off: never",
                        choices=("auto", "off")),
        "compress": Option(str, "off", "auto: also plan with every float cut edge sent int8 both ways (codec "
                                       "compute included) and keep that plan when its predicted step is lower; "
                                       "the choice is what compress-boundary{activations=auto,gradients=auto} "
                                       "inserts (partition_compress.py)", choices=("off", "auto")),
        "grad_compress": Option(str, "none", "how the replicas all-reduce gradients, as vgraph launch "
                                             "--grad-compress: none or powersgd[:rank=R,start=N] (priced by "
                                             "the step cost model: fewer bytes, more compute)"),
    }

    def run(self, graph: Graph, ctx: PassContext) -> Counter:
        fleet_spec = self.opts["fleet"] or ctx.data.get("fleet")
        if fleet_spec is None:
            raise PassError("pass 'partition' needs a fleet: give partition{fleet=FILE} or --fleet FILE")
        batch, micro = self.opts["batch"], self.opts["micro_batches"]
        if batch < 1 or micro < 1:
            raise PassError(f"pass 'partition': batch and micro_batches must be >= 1, got {batch}, {micro}")
        try:
            replicas = parse_replicas(self.opts["replicas"])
            grad_compress = parse_grad_compress(self.opts["grad_compress"])
        except ValueError as exc:
            raise PassError(f"pass 'partition': {exc}") from None
        fleet = resolve_fleet(fleet_spec)
        auto = self.opts["compress"] == "auto"
        try:
            with paused_gc():
                rplan, cm, chosen = plan_compressed(graph, fleet, batch=batch, micro_batches=micro,
                                                    replicas=replicas, grad_compress=grad_compress, auto=auto)
        except PartitionError as exc:
            if self.opts["remat"] == "off" or marked_ids(graph):
                raise
            rplan, cm, chosen = self._plan_with_remat(graph, fleet, batch, micro, replicas, exc, ctx,
                                                      grad_compress, auto)
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
        if grad_compress.enabled:
            placed["grad_compress"] = grad_compress.text()
        if auto:
            placed["compress"] = chosen
            ctx.notes.append(describe_choice(chosen))
        ctx.notes.append(f"partition: {len(graph)} VNodes on {where} of {fleet.name!r}, predicted step "
                         f"{rplan.cost.step_seconds:.4g} s (all-reduce {rplan.cost.allreduce_seconds:.4g} s), "
                         f"bottleneck {placed['bottleneck_seconds']:.4g} s ('{placed['bottleneck_pnode']}'), "
                         f"{human_bytes(ev.cut if ev else placed['cut_bytes_per_step'])} cut per step")
        return Counter(placed=changed)

    @staticmethod
    def _plan_with_remat(graph: Graph, fleet, batch: int, micro: int, replicas, without: PartitionError,
                         ctx: PassContext, grad_compress, auto: bool):
        """No plan fits as the network keeps every activation: mark every remat candidate and plan again."""
        cm = cost_model(graph, batch=batch, micro_batches=micro)
        ids = list(cm.node_columns["id"])
        marks = closed(graph, [c for cs in candidates(graph, cm, ids, {}).values() for c in cs])
        if not marks:
            raise without
        for nid in marks:
            graph.node(nid).set_config(remat=RECOMPUTE)
        try:
            with paused_gc():
                planned = plan_compressed(graph, fleet, batch=batch, micro_batches=micro, replicas=replicas,
                                          grad_compress=grad_compress, auto=auto)
        except PartitionError:
            for nid in marks:
                graph.node(nid).set_config(remat=None)
            raise without from None
        ctx.notes.append(f"partition: no plan keeps every activation at batch {batch} ({without}); with {len(marks)} "
                         f"VNodes recomputed in backward (remat: every candidate) it fits; add the remat pass after "
                         f"partition to recompute only what each PNode needs")
        return planned

