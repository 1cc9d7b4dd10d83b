"""Should a running training change its plan for a new fleet?  The decision, priced like everything else.

When a machine joins a running `vgraph launch` (or one leaves), the planner can usually find a plan with a
shorter step on the new fleet: more replicas, a deeper or rebalanced pipeline.  Changing plans is not free:
every VNode whose state lands on a PNode that did not hold it must get its parameters and optimizer state
(master weights, moments) over the network from a PNode that holds them now, and the workers stop at a step
boundary and start again.  A change pays only when the time it saves over the steps that are left exceeds
that price:

    gain   = (old_step - new_step) x steps_left
    cost   = move_seconds + overhead_s
    margin = uncertainty x old_step x steps_left
    choose the new plan  iff  gain > cost + margin   (or the old plan lost a PNode: it cannot go on)

`uncertainty` is how far the figures both steps were priced from may be off, as a share of the step: 0 for a
join or a leave (the probe's figures, which the testbed checks), and for a drift the spread of the busy times
it measured (placement/drift.relative_spread).  Why a margin: on bench_churn's 0.35-core hosts (2026-12-07, run
7) one PNode's busy time read 0.10, 0.21, 0.10, 0.075 and 0.059 s at steps 8-216; two drift re-plans priced a
gain of 5-7 s (3-10% of the step) from five steps of such figures, paid 5.6 and 5.9 s each, and the plan they
chose measured 0.24 s a step against its 0.15 s predicted.  A gain smaller than what the figures' own spread
can account for is not evidence.

`move_seconds` prices the transfers as the step cost prices a pipeline's traffic (vgraph/cost/stepcost.py):
each moved VNode comes from the old holder with the fastest link to its new holder (`Fleet.link`: the
sender's bandwidth, or a slower region link, plus its latency), the transfers of one sender queue on its
link, those into one receiver queue on its link, links are full duplex and distinct pairs run at once, so
the move takes its busiest link's time.  Gradients do not move (a step boundary has none) and activations
do not either (none are kept across steps).

`overhead_s` is what the boundary itself costs whatever moves: today the launcher's restart path (the
workers finish the step and rank 0 writes a checkpoint, the next attempt is placed, its workers are forked
and meet in a new rendezvous, and each rank loads its share of the checkpoint).  DEFAULT_REPLAN_OVERHEAD_S is
that, measured: in `tests/test_elastic_launch.py`'s loopback run (a tiny 2-layer network, one worker, then
two on two launchers; a 2-core AMD EPYC VM at load average 16, 2026-12-07) the workers stopped and saved 1.3 s
after the stop request, the new attempt's workers were started 1.9 s after it and finished their first step
0.8 s later: 2.7 s, about 0.3 s of it the two steps' own compute, so 2.4 s of boundary; 3 s leaves room for
a slower machine.  With a bigger network the checkpoint write and read grow with the state, which the
move's bytes price.

Pure and torch-free: the decision reads plans as assignments (VNode -> PNode per replica), their predicted
steps, each VNode's state bytes and the fleet's links; `best_plan` asks the partition pass (through the
pass pipeline, so the core stays free of `passes/`) for the plan on the new fleet.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from vgraph.base.diagnostics import VGraphError
from vgraph.cost.costmodel import cost_model
from vgraph.cost.fleet import Fleet, human_bytes
from vgraph.cost.stepcost import replica_assignment
from vgraph.ir.graph import Graph

__all__ = ["DEFAULT_REPLAN_OVERHEAD_S", "PlanView", "Move", "Replan", "state_bytes", "price_move", "decide",
           "best_plan"]

#: Seconds a plan change costs besides moving state: the restart boundary, measured (module docstring).
DEFAULT_REPLAN_OVERHEAD_S = 3.0


@dataclass(frozen=True)
class PlanView:
    """A plan as the decision sees it: who holds each VNode's state, and its predicted step."""

    step_seconds: float
    holders: Mapping[str, frozenset[str]]  # VNode -> the PNodes holding its state (one per replica)

    @property
    def pnodes(self) -> frozenset[str]:
        return frozenset(p for ps in self.holders.values() for p in ps)

    @classmethod
    def of(cls, assignment: Mapping[str, str], replica_pnodes: Sequence[Sequence[str]] | None,
           step_seconds: float) -> "PlanView":
        """From replica 0's assignment and the replicas' rows of PNodes (stage order; None: one replica)."""
        rows = [list(r) for r in replica_pnodes] if replica_pnodes and len(replica_pnodes) > 1 else None
        holders: dict[str, set[str]] = {v: {p} for v, p in assignment.items()}
        if rows:
            for r in range(1, len(rows)):
                for v, p in replica_assignment(assignment, rows, r).items():
                    holders[v].add(p)
        if not (isinstance(step_seconds, (int, float)) and step_seconds > 0 and not math.isnan(step_seconds)):
            raise VGraphError(f"a plan's predicted step must be a positive number of seconds, got {step_seconds!r}")
        return cls(float(step_seconds), {v: frozenset(ps) for v, ps in holders.items()})

    @classmethod
    def of_report(cls, report: Mapping[str, Any]) -> "PlanView":
        """From a placement report (placement.json): its assignment, replica rows and predicted step."""
        try:
            return cls.of(report["assignment"], report.get("replica_pnodes"),
                          report.get("step_seconds", report.get("bottleneck_seconds")))
        except (KeyError, TypeError) as exc:
            raise VGraphError(f"not a placement report: {exc}") from None


@dataclass(frozen=True)
class Move:
    """The state a plan change moves: (VNode, from PNode, to PNode, bytes) and the seconds it takes."""

    transfers: tuple[tuple[str, str, str, float], ...]
    seconds: float
    from_checkpoint: tuple[str, ...] = ()  # VNodes no surviving PNode holds: read from the last checkpoint

    @property
    def bytes(self) -> float:
        return float(sum(b for *_, b in self.transfers))


@dataclass(frozen=True)
class Replan:
    """What the decision chose and why; `describe()` is the line the launcher logs."""

    chosen: str  # "new" (change plans) or "keep"
    reason: str
    old_step: float  # inf when the old plan lost a PNode
    new_step: float
    steps_left: int
    move: Move = field(repr=False)
    overhead_s: float
    margin_s: float = 0.0  # what the figures' spread leaves uncertain over the steps left (module docstring)

    @property
    def bytes_moved(self) -> float:
        return self.move.bytes

    @property
    def move_seconds(self) -> float:
        return self.move.seconds

    @property
    def gain_seconds(self) -> float:
        """Seconds the new plan saves over the steps left (inf when the old plan cannot go on)."""
        return (self.old_step - self.new_step) * self.steps_left if math.isfinite(self.old_step) else math.inf

    def describe(self) -> str:
        old = f"{self.old_step:.4g} s" if math.isfinite(self.old_step) else "cannot go on"
        return (f"{'re-plan' if self.chosen == 'new' else 'keep the plan'}: {self.reason} (step {old} -> "
                f"{self.new_step:.4g} s predicted, {self.steps_left} step(s) left, {human_bytes(self.bytes_moved)} "
                f"of state in {len(self.move.transfers)} transfer(s), move {self.move_seconds:.3g} s + "
                f"{self.overhead_s:.3g} s boundary)")

    def to_json(self) -> dict[str, Any]:
        gain = self.gain_seconds
        return {"chosen": self.chosen, "reason": self.reason,
                "old_step_s": self.old_step if math.isfinite(self.old_step) else None, "new_step_s": self.new_step,
                "steps_left": self.steps_left, "bytes_moved": self.bytes_moved, "move_s": self.move_seconds,
                "overhead_s": self.overhead_s, "gain_s": gain if math.isfinite(gain) else None,
                "margin_s": self.margin_s,
                "vnodes_moved": len({v for v, *_ in self.move.transfers}),
                "from_checkpoint": list(self.move.from_checkpoint)}


def state_bytes(graph: Graph) -> dict[str, float]:
    """Bytes of each VNode's state that a new holder needs: parameters and optimizer state (master weights,
    moments), as the cost model counts them (vgraph/cost/costmodel.py); gradients are rebuilt every step."""
    cm = cost_model(graph, batch=1)
    return {v: float(c.param_bytes + c.optimizer_bytes) for v, c in cm.nodes.items()}


def price_move(old: PlanView, new: PlanView, sizes: Mapping[str, float], fleet: Fleet,
               gone: Iterable[str] = ()) -> Move:
    """The transfers from `old` to `new` and their seconds (module docstring); `gone`: PNodes that left and
    can send nothing.  `fleet` must name every PNode of both plans that can still send or receive.

    A VNode that only PNodes in `gone` held comes from the last checkpoint (named in `from_checkpoint`; its
    bytes are not priced here: the restart path reads the checkpoint whatever moves)."""
    lost = set(gone)
    pnode_of = {p.id: p for p in fleet}  # looked up per transfer: a table, not a scan of the fleet
    transfers: list[tuple[str, str, str, float]] = []
    from_checkpoint: list[str] = []
    out_s: dict[str, float] = {}
    in_s: dict[str, float] = {}
    for v in sorted(new.holders):
        have = sorted(old.holders.get(v, frozenset()) - lost)
        arriving = sorted(new.holders[v] - old.holders.get(v, frozenset()))
        size = float(sizes.get(v, 0.0))
        if not arriving or size <= 0:
            continue
        if not have:
            from_checkpoint.append(v)
            continue
        for q in arriving:
            dst = pnode_of[q]

            def seconds(p: str) -> float:
                bandwidth, latency = fleet.link(pnode_of[p], dst)
                return size / bandwidth + latency

            src = min(have, key=seconds)  # the fastest holder (ties: the first by id)
            transfers.append((v, src, q, size))
            took = seconds(src)
            out_s[src] = out_s.get(src, 0.0) + took
            in_s[q] = in_s.get(q, 0.0) + took
    busiest = max([*out_s.values(), *in_s.values()], default=0.0)
    return Move(tuple(transfers), busiest, tuple(from_checkpoint))


def decide(old: PlanView, new: PlanView, sizes: Mapping[str, float], fleet: Fleet, steps_left: int, *,
           gone: Iterable[str] = (), overhead_s: float = DEFAULT_REPLAN_OVERHEAD_S, uncertainty: float = 0.0
           ) -> Replan:
    """Keep `old` or change to `new` (module docstring), with the numbers that decided it."""
    if isinstance(steps_left, bool) or not isinstance(steps_left, int) or steps_left < 0:
        raise VGraphError(f"steps left must be a whole number >= 0, got {steps_left!r}")
    for what, value in (("the re-plan overhead", overhead_s), ("the figures' uncertainty", uncertainty)):
        if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise VGraphError(f"{what} must be a finite number >= 0, got {value!r}")
    lost = set(gone)
    move = price_move(old, new, sizes, fleet, lost)
    broken = sorted(old.pnodes & lost)
    old_step = math.inf if broken else old.step_seconds
    margin = 0.0 if broken else uncertainty * old.step_seconds * steps_left

    def replan(chosen: str, reason: str) -> Replan:
        return Replan(chosen, reason, old_step, new.step_seconds, steps_left, move, float(overhead_s), margin)

    if broken:
        return replan("new", f"the plan lost {', '.join(broken)}")
    if {v: set(p) for v, p in new.holders.items()} == {v: set(p) for v, p in old.holders.items()}:
        return replan("keep", "the planner's best plan is the current one")
    gain = (old.step_seconds - new.step_seconds) * steps_left
    cost = move.seconds + overhead_s
    spread = f" and the {margin:.3g} s its figures' spread (±{uncertainty:.0%} a step) leaves uncertain" if margin else ""
    if gain > cost + margin:
        return replan("new", f"saves {gain:.3g} s over the steps left, more than the {cost:.3g} s the change "
                             f"costs{spread}")
    if new.step_seconds >= old.step_seconds:
        return replan("keep", "the new plan is not faster")
    return replan("keep", f"saves only {gain:.3g} s over the steps left, not the {cost:.3g} s the change "
                          f"costs{spread}")


def best_plan(graph: Graph, fleet: Fleet, partition: str, target: str | None = None) -> tuple[PlanView, Graph]:
    """The planner's best plan for `graph` (the network as the partition pass sees it: after the passes
    before it) on `fleet`, through the pass pipeline (`partition`: the pass with its options, as
    launch's `split_pipeline` writes it); the view and the partitioned copy."""
    from vgraph.transform.pipeline import run_pipeline

    placed = graph.copy()
    run_pipeline(placed, partition, target=target, data={"fleet": fleet})
    planned = dict(placed.meta.get("placement") or {})
    assignment = {n.id: n.meta["pnode"] for n in placed.nodes}
    rows = planned.get("replica_pnodes") if planned.get("replicas", 1) > 1 else None
    step = planned.get("step_seconds", planned.get("bottleneck_seconds"))
    return PlanView.of(assignment, rows, step), placed
