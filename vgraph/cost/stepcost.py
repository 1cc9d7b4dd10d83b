"""What one training step costs on S pipeline stages x R data-parallel replicas.

A *plan* runs R copies (replicas) of one pipeline of S stages.  Every replica
cuts the network the same way (stage s holds the same VNodes in every replica),
so stage s's PNodes, one per replica, hold the same parameters: after the
backward pass they average their gradients with a ring all-reduce, and every
replica steps identically.  Replica r trains on `shares[r]` samples of the
global batch B (integers summing to B; a slow replica gets fewer).

With the per-stage loads of `stage_loads` (vgraph/cost/tasks.py), replica r
with batch share b, M_r = min(M, b) micro-batches and stage s on PNode p:

    compute(r, s) = b * flops(s) / flops(p)                   compute
                  + M_r * overhead(s, p)                       fixed cost per micro-batch
    link(r, s)  = b * max(sum_t send(s, t) / bw(p -> q_t),     activations and gradients it sends,
                          sum_t send(t, s) / bw(q_t -> p))     or receives: the busier direction
    work(r, s)  = max(compute(r, s), link(r, s))
    sync(r, s)  = sum_t tie(s, t) / bw(p -> q_t)              tied weights, once a step
    replica(r)  = the makespan of the workers' schedule       `pipeline_seconds`, below
    reduce(s)   = 2 (R - 1) / R * grad_bytes(s) / min(slowest link of stage s's group, ring(N))
                + 2 (R - 1) * (the group's largest latency + hop(N))   (ring all-reduce)
                  (PowerSGD, `--grad-compress`: grad_bytes(s) is what it all-reduces, the latency counts
                  three rounds, and its FLOPs on the group's slowest member are added; compression.py)
    control     = the fleet's measured control collectives over all N = R x S ranks (collectives.py)
    update(r, s) = fixed(p) + params(s) * per_param(p)        the rank's batch draw and optimizer step
                                                              (the PNode's probed `update`, update.py)
    step        = max_r replica(r) + max_s reduce(s) + control + max_{r,s} update(r, s)

hop(N) is the fleet's measured time of one message while N ranks communicate and ring(N) the bytes a
second their all-reduce moves (collectives.py); hop is added to every message of the pipelines as well; a
fleet without the table has hop 0, control 0 and no ring cap; a PNode without `update` spends nothing on it.

A replica's pipeline is priced as the workers run it: its stages' tasks (tasks.py: a stage runs its
VNodes in one task per depth, so the stage holding the embedder and the tied LM head runs the first task
and the last), ordered by the same 1F1B or GPipe schedule the torch backend executes (schedule.py), each
op lasting its share of compute(r, s) on its micro-batch and each tensor its bytes over the sender's link,
simulated to its makespan (makespan.py).  On S equal stages with no traffic that is the closed form
(M + S - 1) / M x the stage's time, which this model used for every pipeline until the testbed ran a
2-stage cut whose first PNode also runs the LM head (h0 -> h1 -> h0) at 1.2x-2.5x that formula: 1F1B keeps at
most min(M, S) micro-batches in flight on a rank, and over a chain of three tasks on two ranks the step
comes out near the serial sum of the stages.

Compute and traffic overlap, and the two directions of a link do not compete: a worker sends with
`isend` and computes the next micro-batch while its output is on the wire, and a link is full duplex
(on the netlab testbed each direction has its own rate).  Charging their sum, as this model did before
the testbed measured it, predicted pipelines over a 20 Mbit/s link 2.4x to 5x slower than they ran.  In
the simulation a rank's outgoing tensors queue on its link one after another; incoming ones do not queue
(in a chain a rank's incoming traffic is its neighbours' outgoing, already queued there).

When PNode p carries `vgraph probe`'s figures (vgraph/cost/op_kinds.py), compute is priced per op kind
k: `flops(s) / flops(p)` becomes `sum_k flops_k(s) / (flops(p) * of_peak_k(p))` and `overhead(s, p)` is
`sum_k VNodes_k(s) * overhead_k(p)`; without them, of_peak is 1 and overhead 0 (the single figure).

`bw(p -> q)` is `Fleet.link`: the sending PNode's bandwidth, or less across a
slow region link (vgraph/cost/fleet_links.py).  The stage groups all-reduce at the
same time on disjoint PNodes, hence the max; the all-reduce starts after the
last backward (no overlap is assumed: the prediction is an upper bound there).
With M = 1 a pipeline runs its tasks and tensors one after another (their sum);
`bottleneck_seconds`, the partition pass's objective, is max work + sync with
no bubble, as before.  Batch shares balance the replicas' simulated pipelines
(`balanced_shares`, starting from `batch_shares` on a linear model of them).

Memory of stage s on replica r: parameters, gradients and optimizer state of
its VNodes, a replica of each tied weight it reads from another stage, and the
activations of ceil(b / M_r) x min(M_r, S) resident samples (1F1B).

Bytes on the wire per step (what workers measure): every cut edge once per
sample in each direction it carries (activation, gradient), every tied-weight
sync, and per stage group 2 (R - 1) x grad_bytes (each of the R ring members
sends 2 (R - 1) / R of the gradients).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cached_property
from math import ceil
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import numpy as np

from vgraph.base.diagnostics import VGraphError
from vgraph.cost.costmodel import CostModel
from vgraph.cost.makespan import Durations, compile_program, makespan
from vgraph.cost.op_kinds import KINDS
from vgraph.cost.tasks import LoadColumns, StageLoads, stage_loads, vnode_kinds

if TYPE_CHECKING:
    from vgraph.cost.fleet import Fleet, PNode

__all__ = ["StageLoads", "StepCost", "FleetArrays", "LoadColumns", "stage_loads", "step_cost", "step_cost_of",
           "compute_per_sample", "stage_overhead", "compute_seconds", "effective_flops", "vnode_kinds",
           "stage_rates", "ring_allreduce_bytes", "bubble", "resident_array", "pipeline_seconds",
           "resident_samples", "replica_assignment", "batch_shares", "balanced_shares", "shares_by_speed",
           "allreduce_seconds", "step_lower_bound"]


def effective_flops(cm: CostModel, fleet: "Fleet") -> np.ndarray:
    """Per VNode (cost model order), a step's training FLOPs as the fleet's typical PNode prices them, in
    FLOPs of its peak: FLOPs over the kind's share of the peak, plus micro-batches x the kind's overhead x
    the peak (medians over the fleet).  The partition heuristic's unit costs (passes/partition_problem.py),
    so that a cut balances time rather than FLOPs; without a probe's figures, the FLOPs themselves."""
    fa = FleetArrays(fleet)
    flops = cm.train_flops_per_sample() * cm.batch
    if not fa.by_kind:
        return flops
    kind = vnode_kinds(cm)
    of_peak, overhead = np.median(fa.of_peak, axis=1), np.median(fa.overhead, axis=1)
    return flops / of_peak[kind] + cm.micro_batches * overhead[kind] * float(np.median(fa.flops))


def bubble(micro_batches: int, stages: int) -> float:
    """GPipe/1F1B pipeline factor: a step takes (M + S - 1) micro-batch slots of the slowest stage."""
    return (micro_batches + stages - 1) / micro_batches


def resident_samples(share: int, micro_batches: int, stages: int) -> int:
    """Samples whose activations a stage keeps at once under 1F1B (`CostModel.resident_samples`)."""
    m = max(1, min(micro_batches, share))
    return ceil(share / m) * min(m, stages)


def resident_array(shares: np.ndarray, micro_batches: int, stages: int) -> np.ndarray:
    """`resident_samples` of every share at once."""
    b = np.maximum(np.asarray(shares, dtype=np.int64), 1)
    m = np.minimum(max(1, micro_batches), b)
    return -(-b // m) * np.minimum(m, stages)


def ring_allreduce_bytes(replicas: int, grad_bytes: float) -> float:
    """Bytes the whole group sends in a ring all-reduce: each of R members sends 2 (R - 1) / R of them."""
    return 2.0 * (replicas - 1) * grad_bytes if replicas > 1 else 0.0


@dataclass
class StepCost:
    step_seconds: float
    pipeline_seconds: float  # slowest replica, bubble and sync included
    allreduce_seconds: float  # slowest stage group's ring all-reduce
    bottleneck_seconds: float  # max over PNodes of work + sync (the partition pass's objective)
    replica_seconds: np.ndarray  # [R]
    stage_seconds: np.ndarray  # [R, S] work + sync per step
    allreduce_stage_seconds: np.ndarray  # [S]
    memory: np.ndarray  # [R, S] bytes
    capacity: np.ndarray  # [R, S] bytes
    p2p_bytes: np.ndarray  # [R] bytes per step sent inside each replica (edges both ways, tie syncs)
    allreduce_bytes: np.ndarray  # [S] bytes per step sent by each stage group
    control_seconds: float = 0.0  # the step's control collectives over all ranks (the fleet's measured table)
    update_seconds: float = 0.0  # the slowest rank's batch draw and optimizer step (the PNodes' `update`)
    compute_seconds: np.ndarray | None = None  # [R, S] each rank's own compute per step (no communication)

    @property
    def fits(self) -> bool:
        return bool(np.all(self.memory <= self.capacity))

    @property
    def bytes_per_step(self) -> float:
        return float(self.p2p_bytes.sum() + self.allreduce_bytes.sum())


class FleetArrays:
    """A fleet as arrays (speed, bandwidth, memory, region per PNode; region links as matrices), so a
    plan given as PNode indices `idx[r, s]` is priced without a Python loop over PNodes."""

    def __init__(self, fleet: "Fleet") -> None:
        self.fleet = fleet
        self.pnodes = list(fleet.pnodes)
        self.index = {p.id: i for i, p in enumerate(self.pnodes)}
        self.flops = np.array([p.flops for p in self.pnodes], dtype=float)
        self.bandwidth = np.array([p.bandwidth for p in self.pnodes], dtype=float)
        self.memory = np.array([p.memory for p in self.pnodes], dtype=float)
        names = list(fleet.links.regions)
        at = {name: i for i, name in enumerate(names)}
        self.region = np.array([at.get(p.region, 0) for p in self.pnodes], dtype=np.int64)
        n = max(1, len(names))
        self.region_bw = np.full((n, n), np.inf)
        self.region_lat = np.zeros((n, n))
        for name, reg in fleet.links.regions.items():
            i = at[name]
            self.region_bw[i, i] = reg.bandwidth or np.inf
            self.region_lat[i, i] = reg.latency
        for pair, (bw, lat) in fleet.links.pairs.items():
            a, b = (at[x] for x in pair)
            self.region_bw[a, b] = self.region_bw[b, a] = bw
            self.region_lat[a, b] = self.region_lat[b, a] = lat
        self.regions = len(names)
        # Per op kind and PNode (vgraph/cost/op_kinds.py): the share of `flops` reached, the seconds per VNode
        # and micro-batch; a PNode without a probe's figures keeps FLOPs / peak (share 1, no overhead).
        self.of_peak = np.ones((len(KINDS), len(self.pnodes)))
        self.overhead = np.zeros((len(KINDS), len(self.pnodes)))
        for j, p in enumerate(self.pnodes):
            if p.efficiency is not None:
                for k, kind in enumerate(KINDS):
                    self.of_peak[k, j] = p.efficiency.of_peak(kind)
                    self.overhead[k, j] = p.efficiency.overhead(kind)
        self.by_kind = any(p.efficiency is not None for p in self.pnodes)
        self.burst = np.array([p.burst for p in self.pnodes], dtype=float)
        # A CPU quota's burst (vgraph/cost/cpu_quota.py): speed after idling over the figures' rate, bucket seconds.
        self.cpu_speedup = np.array([p.cpu_burst.speedup if p.cpu_burst else 1.0 for p in self.pnodes], dtype=float)
        self.cpu_bucket = np.array([p.cpu_burst.bucket if p.cpu_burst else 0.0 for p in self.pnodes], dtype=float)
        self.collectives = fleet.collectives
        # A rank's work a step beyond its program (vgraph/cost/update.py): fixed seconds, seconds a parameter.
        self.update_fixed = np.array([p.update.fixed if p.update else 0.0 for p in self.pnodes], dtype=float)
        self.update_per_param = np.array([p.update.per_param if p.update else 0.0 for p in self.pnodes], dtype=float)

    @cached_property
    def balanced(self) -> np.ndarray:
        """Speed and bandwidth, each against the fleet's median, the lower of the two: a fast machine on
        a slow link is no better than its link (an ordering key for layouts)."""
        return np.minimum(self.flops / float(np.median(self.flops)), self.bandwidth / float(np.median(self.bandwidth)))

    def link(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(bandwidth, latency) from PNodes `src` to PNodes `dst` (index arrays of one shape)."""
        ra, rb = self.region[src], self.region[dst]
        return np.minimum(self.bandwidth[src], self.region_bw[ra, rb]), self.region_lat[ra, rb]


def step_cost(loads: StageLoads, pnodes: Sequence[Sequence["PNode"]], shares: Sequence[int], micro_batches: int,
              fleet: "Fleet | None" = None, pipeline: str = "1f1b") -> StepCost:
    """The cost of a plan: `pnodes[r][s]` runs stage s of replica r on `shares[r]` samples."""
    from vgraph.cost.fleet import Fleet

    if fleet is None:
        seen = {p.id: p for row in pnodes for p in row}
        fleet = Fleet("plan", tuple(seen.values()))
    arrays = FleetArrays(fleet)
    idx = np.array([[arrays.index[p.id] for p in row] for row in pnodes], dtype=np.int64).reshape(len(pnodes), -1)
    return step_cost_of(loads, arrays, idx, shares, micro_batches, pipeline)


def stage_rates(loads: StageLoads, fa: FleetArrays, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per slot of `idx` [R, S]: seconds per sample (compute or traffic, whichever is longer: they overlap),
    seconds per step of tied-weight sync; per replica: the latency of its stage-to-stage links (fill and
    drain)."""
    per_sample, sync, latency = _link_terms(loads, fa, idx)
    return np.maximum(compute_per_sample(loads, fa, idx), per_sample), sync, latency


def _link_terms(loads: StageLoads, fa: FleetArrays, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per slot [R, S]: seconds per sample on the links, the longer of what the stage sends and what it
    receives (links are full duplex); seconds per step of tied-weight sync; per replica: link latency."""
    R, S = idx.shape
    send = loads.send if loads.send is not None else loads.p2p / 2  # hand-made loads: half each way
    out, into = np.zeros((R, S)), np.zeros((R, S))
    sync = np.zeros((R, S))
    latency = np.zeros(R)
    talk = np.argwhere(((loads.p2p > 0) | (loads.sync > 0)) & ~np.eye(S, dtype=bool))
    if len(talk):
        s, t = talk[:, 0], talk[:, 1]
        bw, lat = fa.link(idx[:, s], idx[:, t])  # [R, pairs]: s -> t
        np.add.at(out.T, s, (send[s, t][None, :] / bw).T)
        np.add.at(into.T, t, (send[s, t][None, :] / bw).T)
        np.add.at(sync.T, s, (loads.sync[s, t][None, :] / bw).T)
        latency = 2 * np.where(s < t, lat, 0.0).sum(axis=1)
    return np.maximum(out, into), sync, latency


def compute_per_sample(loads: StageLoads, fa: FleetArrays, idx: np.ndarray) -> np.ndarray:
    """[R, S] seconds of compute per sample: each op kind's FLOPs at its share of the PNode's peak (a PNode
    without a probe's figures: all FLOPs at its peak, the single-figure model)."""
    if not fa.by_kind or loads.kind_flops is None:
        return loads.flops[None, :] / fa.flops[idx]
    return sum(loads.kind_flops[k][None, :] / (fa.flops[idx] * fa.of_peak[k][idx]) for k in range(len(KINDS)))


def stage_overhead(loads: StageLoads, fa: FleetArrays, idx: np.ndarray) -> np.ndarray:
    """Per slot of `idx` [R, S]: the fixed seconds of one micro-batch through the stage, every VNode's
    per-kind overhead on its PNode (zero without a probe's figures)."""
    if not fa.by_kind or loads.kind_ops is None:
        return np.zeros(idx.shape)
    return sum(loads.kind_ops[k][None, :] * fa.overhead[k][idx] for k in range(len(KINDS)))


def compute_seconds(loads: StageLoads, fa: FleetArrays, idx: np.ndarray, shares: Sequence[int], micro_batches: int
                    ) -> np.ndarray:
    """[R, S] seconds of compute per step: share x per-sample cost by kind + micro-batches x overhead."""
    b = np.asarray(shares, dtype=float)
    micro = np.minimum(max(1, micro_batches), np.maximum(b, 1))
    return b[:, None] * compute_per_sample(loads, fa, idx) + micro[:, None] * stage_overhead(loads, fa, idx)


def pipeline_seconds(loads: StageLoads, fa: FleetArrays, idx: np.ndarray, shares: Sequence[int],
                     micro_batches: int, pipeline: str = "1f1b", rows: np.ndarray | None = None,
                     ranks: int | None = None) -> np.ndarray:
    """Seconds of each replica's pipeline: the makespan of the schedule its workers run
    (vgraph/cost/schedule.py, simulated by vgraph/cost/makespan.py) over the stages' tasks.  One per
    replica (row of `idx`) at `shares`, or with `rows`, replica rows[i] at shares[i] (a replica priced at
    several shares: the PNodes' figures are read once per replica).

    Micro-batch m of replica r has the size the worker cuts (`plan.micro_batch_sizes`); a task's op on it
    takes size x seconds per sample (per op kind) + the task's fixed overhead, the forward its share of
    the task's FLOPs, the backward the rest; a tensor between stages occupies the sender's uplink for
    size x bytes per sample / `Fleet.link` bandwidth, less what the sender's burst passes at once
    (makespan.py), plus the link's latency and the fleet's measured hop among `ranks` ranks (default: all
    of `idx`; collectives.py); a tied pair's sync takes its bytes, half each way, plus both latencies each
    way."""
    tasks = loads.tasks
    S = idx.shape[1]
    rows = np.arange(len(idx)) if rows is None else np.asarray(rows, dtype=np.int64)
    b = np.maximum(np.asarray(shares, dtype=np.int64), 1)
    micro = np.minimum(max(1, micro_batches), b)
    on = idx[:, tasks.stage]  # [R, T] the PNode of each task
    per_sample, overhead = compute_per_sample(tasks, fa, on), stage_overhead(tasks, fa, on)
    src = tasks.stage[[e.src for e in tasks.edges]].astype(np.int64)
    dst = tasks.stage[[e.dst for e in tasks.edges]].astype(np.int64)
    _, hop = fa.collectives.at(idx.size if ranks is None else ranks)
    bw, latency = fa.link(idx[:, src], idx[:, dst])
    latency = latency + hop
    bw_back, _ = fa.link(idx[:, dst], idx[:, src])
    act, grad = tasks.act / bw, tasks.grad / bw_back  # [R, E] seconds per sample
    bucket = fa.burst[idx] / fa.bandwidth[idx]  # [R, S] seconds of its own rate a rank's burst holds
    cpu = (fa.cpu_speedup[idx], fa.cpu_bucket[idx]) if np.any(fa.cpu_bucket[idx] > 0) else None  # [R, S] each
    ties, pairs = loads.tied
    tie = np.zeros((len(idx), len(pairs)))
    for p, (a, c) in enumerate(pairs):
        there, lat = fa.link(idx[:, a], idx[:, c])
        back, _ = fa.link(idx[:, c], idx[:, a])
        tie[:, p] = loads.sync[a, c] / 2 * (1 / there + 1 / back) + 2 * (lat + hop)
    out = np.empty(len(rows))
    for m in np.unique(micro).tolist():
        pick = np.flatnonzero(micro == m)
        r = rows[pick]
        sizes = (b[pick] // m)[:, None] + (np.arange(m)[None, :] < (b[pick] % m)[:, None])  # [n, m]
        compute = sizes[:, None, :] * per_sample[r][:, :, None] + overhead[r][:, :, None]  # [n, T, m]
        forward = compute * tasks.forward[None, :, None]
        durations = Durations(forward, compute - forward, sizes[:, None, :] * act[r][:, :, None],
                              sizes[:, None, :] * grad[r][:, :, None], latency[r], tie[r], bucket[r],
                              *((cpu[0][r], cpu[1][r]) if cpu is not None else ()))
        out[pick] = makespan(compile_program(tasks.scheduled, tasks.edges, S, m, pipeline, ties), durations)
    return out


def step_cost_of(loads: StageLoads, fa: FleetArrays, idx: np.ndarray, shares: Sequence[int], micro_batches: int,
                 pipeline: str = "1f1b", replica_seconds: np.ndarray | None = None) -> StepCost:
    """`step_cost` for a plan given as fleet indices `idx[r, s]` (what the planner evaluates by the thousand);
    `replica_seconds`: the replicas' `pipeline_seconds` at these shares, when the caller has them already."""
    R, S = idx.shape
    if R < 1 or S != loads.stages or len(shares) != R:
        raise ValueError(f"a plan needs R >= 1 rows of {loads.stages} PNodes and R batch shares")
    b = np.asarray(shares, dtype=float)
    link, sync, _ = _link_terms(loads, fa, idx)
    compute = compute_seconds(loads, fa, idx, shares, micro_batches)
    work = np.maximum(compute, b[:, None] * link)
    reduce = allreduce_seconds(loads, fa, idx)
    update = float(update_seconds(loads, fa, idx).max())
    resident = resident_array(np.asarray(shares), micro_batches, S).astype(float)
    # The stages' own terms above; the pipeline's schedule (tasks.py, makespan.py) last, when not given.
    replica = (pipeline_seconds(loads, fa, idx, shares, micro_batches, pipeline) if replica_seconds is None
               else np.asarray(replica_seconds, dtype=float))
    memory = loads.static_bytes[None, :] + loads.activation_bytes[None, :] * resident[:, None]
    if R > 1 and loads.reduce_flops is not None:  # compressing gradients: what each member keeps for it
        memory = memory + loads.reduce_memory[None, :]
    p2p_bytes = b * float(np.triu(loads.p2p).sum()) + float(np.triu(loads.sync).sum())
    allreduce_bytes = np.array([ring_allreduce_bytes(R, g) for g in loads.grad_bytes])
    pipeline = float(replica.max())
    all_reduce = float(reduce.max()) if S else 0.0
    control, _ = fa.collectives.at(R * S)
    return StepCost(pipeline + all_reduce + control + update, pipeline, all_reduce, float((work + sync).max()),
                    replica, work + sync, reduce, memory, fa.memory[idx], p2p_bytes, allreduce_bytes, control, update,
                    compute)


def update_seconds(loads: StageLoads, fa: FleetArrays, idx: np.ndarray) -> np.ndarray:
    """[R, S] seconds each rank spends a step on its batch draw and optimizer step (update.py): after the
    step's last collective every rank does its own, and the next step waits for the slowest."""
    params = loads.params if loads.params is not None else np.zeros(loads.stages)
    return fa.update_fixed[idx] + params[None, :] * fa.update_per_param[idx]


def allreduce_seconds(loads: StageLoads, fa: FleetArrays, idx: np.ndarray) -> np.ndarray:
    """[S] seconds of each stage group's gradient all-reduce (ring; PowerSGD's FLOPs on its slowest member);
    every hop pays the group's largest link latency and the fleet's measured hop among all the plan's ranks
    (they all communicate then: collectives.py)."""
    R, S = idx.shape
    reduce = np.zeros(S)
    if R > 1:
        _, hop = fa.collectives.at(R * S)
        ring = fa.collectives.ring(R * S)
        for s in range(S):
            slowest, worst = _slowest_link(fa, idx[:, s])
            reduce[s] = (2 * (R - 1) / R * loads.grad_bytes[s] / min(slowest, ring)
                         + 2 * (R - 1) * (worst + hop) * loads.reduce_rounds)
        if loads.reduce_flops is not None:  # compressing gradients: the slowest member of each group
            reduce += loads.reduce_flops / fa.flops[idx].min(axis=0)
    return reduce


def step_lower_bound(loads: StageLoads, fa: FleetArrays, idx: np.ndarray, batch: int) -> float:
    """A step no split of `batch` over the replicas `idx` [R, S] can beat, cheap enough to skip pricing plans
    that cannot win (the planner's search): a replica takes at least its share times its busiest stage's
    seconds per sample, computing or sending (a rank runs its ops one after another and its outgoing
    tensors queue on its link: `makespan.py`), so the replicas together finish no sooner than the batch
    spread over their speeds, and the all-reduce comes after."""
    compute = compute_per_sample(loads, fa, idx)
    R, S = idx.shape
    send = loads.send if loads.send is not None else loads.p2p / 2
    out = np.zeros((R, S))
    talk = np.argwhere((send > 0) & ~np.eye(S, dtype=bool))
    if len(talk):
        a, c = talk[:, 0], talk[:, 1]
        bw, _ = fa.link(idx[:, a], idx[:, c])
        np.add.at(out.T, a, (send[a, c][None, :] / bw).T)
    per_sample = np.maximum(compute, out).max(axis=1)
    reduce = allreduce_seconds(loads, fa, idx)
    control, _ = fa.collectives.at(R * S)
    return (batch / float((1.0 / np.maximum(per_sample, 1e-300)).sum()) + (float(reduce.max()) if S else 0.0)
            + control + float(update_seconds(loads, fa, idx).max()))


def _slowest_link(fa: FleetArrays, group: np.ndarray) -> tuple[float, float]:
    """(bandwidth, latency) of the slowest link a ring through `group` (fleet indices) may use.

    Conservative with regions: every pair of the group's regions counts (a ring
    through three regions uses all three links; through more, maybe not all),
    and a region's own link counts when two members share it.
    """
    slowest = float(fa.bandwidth[group].min())
    if not fa.regions:
        return slowest, 0.0
    regions, counts = np.unique(fa.region[group], return_counts=True)
    bw = fa.region_bw[np.ix_(regions, regions)].copy()
    lat = fa.region_lat[np.ix_(regions, regions)].copy()
    alone = np.flatnonzero(counts < 2)
    bw[alone, alone] = np.inf
    lat[alone, alone] = 0.0
    return min(slowest, float(bw.min())), float(lat.max())


def batch_shares(batch: int, seconds_per_sample: Sequence[float], fixed: Sequence[float] | None = None,
                 caps: Sequence[int] | None = None) -> list[int] | None:
    """Integer shares of `batch` (each >= 1, at most `caps[r]`) that equalise b_r * a_r + c_r.

    Water-filling: every replica finishes together when b_r = (T - c_r) / a_r;
    the real shares are that, rounded by largest remainder within the caps.
    None when the caps (memory) cannot hold the batch or there are more
    replicas than samples.
    """
    a = np.maximum(np.asarray(seconds_per_sample, dtype=float), 1e-300)
    R = len(a)
    c = np.zeros(R) if fixed is None else np.asarray(fixed, dtype=float)
    cap = np.full(R, batch) if caps is None else np.minimum(np.asarray(caps), batch)
    if R > batch or np.any(cap < 1) or cap.sum() < batch:
        return None
    inv = 1.0 / a
    T = (batch + float((c * inv).sum())) / float(inv.sum())  # closed form when no bound binds
    exact = (T - c) * inv
    if np.any(exact < 1) or np.any(exact > cap):
        lo, hi = 0.0, float((c + a * batch).max())
        for _ in range(60):  # bisection on the common finish time T
            mid = (lo + hi) / 2
            if np.minimum(np.maximum((mid - c) * inv, 1), cap).sum() >= batch:
                hi = mid
            else:
                lo = mid
        exact = np.minimum(np.maximum((hi - c) * inv, 1), cap)
    shares = np.minimum(np.maximum(np.floor(exact), 1), cap).astype(np.int64)
    while shares.sum() > batch:  # rounding up from 1 may overshoot: take from the longest finishers
        finish = np.where(shares > 1, shares * a + c, -np.inf)
        shares[int(np.argmax(finish))] -= 1
    # The rest (< R samples after rounding down), one at a time to whoever would finish it earliest:
    # greedy from below the optimum is optimal for this min-max allocation.
    out = shares.tolist()
    heap = [(float((out[r] + 1) * a[r] + c[r]), r) for r in range(R) if out[r] < cap[r]]
    heapq.heapify(heap)
    for _ in range(batch - int(shares.sum())):
        _, r = heapq.heappop(heap)
        out[r] += 1
        if out[r] < cap[r]:
            heapq.heappush(heap, (float((out[r] + 1) * a[r] + c[r]), r))
    return out


def balanced_shares(seconds: Callable[[np.ndarray, np.ndarray], np.ndarray], batch: int, guess: Sequence[int],
                    caps: Sequence[int]) -> tuple[list[int], np.ndarray]:
    """Integer shares of `batch` (replica r: 1 .. caps[r]) that make the slowest replica the fastest it can
    be, and each replica's seconds at its share, where `seconds(rows, shares)` gives replica rows[i]'s seconds
    at shares[i] (the simulated pipeline: no closed form to water-fill), nondecreasing in the share; `guess`
    (summing to `batch`, within the caps) is where to look, e.g. `batch_shares` on a linear model.

    First the guess is moved to where a line through each replica's seconds at the guess and a quarter
    above it puts the balance (`batch_shares` on those lines: a pipeline's time is close to linear in its
    share once it has all its micro-batches).  Then greedy from below in a window around it: every replica
    starts w samples below, and each sample left goes to whoever would finish it earliest (one batched
    evaluation of the window prices every choice; `_fill_from_below`).  That is optimal for a min-max of
    nondecreasing functions unless a replica ends on the window's edge (it may want fewer samples than the
    window starts it with, or more than it allows): then the window widens and the search runs again."""
    guess = np.asarray(guess, dtype=np.int64)
    cap = np.minimum(np.asarray(caps, dtype=np.int64), batch)
    R = len(guess)
    if R > 1:
        above = np.minimum(guess + np.maximum(1, guess // 4), cap)
        rows = np.flatnonzero(above > guess)
        at = seconds(np.concatenate((np.arange(R), rows)), np.concatenate((guess, above[rows])))
        slope = np.full(R, np.inf)
        slope[rows] = (at[R:] - at[rows]) / (above[rows] - guess[rows])
        slope = np.where(np.isfinite(slope) & (slope > 0), slope, np.nan)
        if not np.isnan(slope).all():  # a replica at its cap, or flat: the others' median slope
            slope = np.where(np.isnan(slope), np.nanmedian(slope), slope)
            better = batch_shares(batch, slope, at[:R] - slope * guess, cap)
            guess = np.asarray(better, dtype=np.int64) if better is not None else guess
    width = 2
    while True:
        lo, hi = np.clip(guess - width, 1, cap), np.clip(guess + width, 1, cap)
        span = hi - lo + 1
        rows = np.repeat(np.arange(R), span)
        k = np.arange(len(rows)) - np.repeat(np.cumsum(span) - span, span)  # replica r at lo[r] + k
        table = np.full((R, int(span.max())), np.inf)
        table[rows, k] = seconds(rows, lo[rows] + k)
        shares = lo + _fill_from_below(table, batch - int(lo.sum()))
        edge = ((shares == hi) & (hi < cap)) | ((shares == lo) & (lo > 1))
        if not edge.any() or width >= batch:
            return shares.tolist(), table[np.arange(R), shares - lo]
        width *= 4


def shares_by_speed(loads: StageLoads, fleet: "Fleet", rows: Sequence[Sequence[str]], batch: int,
                    micro_batches: int) -> list[int]:
    """Batch shares for the replicas `rows` (per replica, its PNodes in stage order) of the cut `loads`: each
    replica's share in proportion to its speed (water-filled on the linear model, then balanced on the
    simulated pipelines), within its memory."""
    fa = FleetArrays(fleet)
    idx = np.array([[fa.index[p] for p in row] for row in rows], dtype=np.int64)
    per_sample, fixed, latency = stage_rates(loads, fa, idx)
    S = idx.shape[1]
    # The largest share every stage of a replica holds: a stage keeps resident_samples(b) samples' activations
    # (as `step_cost` prices one replica's memory), which grows with b, so count the shares that fit.
    resident = resident_array(np.arange(1, batch + 1), micro_batches, S).astype(float)
    need = loads.static_bytes[None, :] + loads.activation_bytes[None, :] * resident[:, None]
    caps = [int((need <= fa.memory[row][None, :]).all(axis=1).cumprod().sum()) for row in idx]
    guess = batch_shares(batch, bubble(micro_batches, S) * per_sample.max(axis=1), fixed.max(axis=1) + latency,
                         caps)
    if guess is None:
        raise VGraphError(f"{len(rows)} replica(s) cannot hold the batch of {batch} (memory, or fewer samples "
                          f"than replicas)")
    shares, _ = balanced_shares(lambda r, b: pipeline_seconds(loads, fa, idx, b, micro_batches, rows=r), batch,
                                guess, caps)
    return shares


def _fill_from_below(table: np.ndarray, samples: int) -> np.ndarray:
    """How many of `samples` each replica gets when each goes, one at a time, to whoever would finish it
    earliest (ties to the lower replica): table[r, k] is replica r's seconds with k more (inf: not allowed).

    Rather than a sample at a time, the least time T by which enough samples fit (bisection over the
    table's values): every replica takes all its samples finishing by T, and those finishing exactly at T
    beyond the count go back, from the highest replica down, as the greedy would not have given them."""
    more = np.maximum.accumulate(table, axis=1)[:, 1:]  # the time with k + 1 more samples, never decreasing
    if samples <= 0 or not more.size:
        return np.zeros(len(table), dtype=np.int64)
    values = np.unique(more[np.isfinite(more)])
    lo, hi = 0, len(values) - 1
    while lo < hi:  # the least value whose samples-finishing-by-it cover `samples`
        mid = (lo + hi) // 2
        if int((more <= values[mid]).sum()) >= samples:
            hi = mid
        else:
            lo = mid + 1
    limit = values[lo]
    got = (more <= limit).sum(axis=1)
    extra = int(got.sum()) - samples
    for r in range(len(got) - 1, -1, -1):
        while extra > 0 and got[r] > 0 and more[r, got[r] - 1] == limit:
            got[r] -= 1
            extra -= 1
    return got


def replica_assignment(assignment: Mapping[str, str], replica_pnodes: Sequence[Sequence[str]], r: int
                       ) -> dict[str, str]:
    """VNode -> PNode of replica r, from replica 0's `assignment` (the PNodes of row 0 name the stages)."""
    stage_of = {pid: s for s, pid in enumerate(replica_pnodes[0])}
    row = replica_pnodes[r]
    return {v: row[stage_of[p]] for v, p in assignment.items()}
