"""Use the whole fleet: R data-parallel replicas of an S-stage pipeline, chosen by the step cost model.

What the plan optimises
-----------------------
The predicted time of one training step of the global batch B
(`vgraph.cost.stepcost`): the slowest replica's pipeline (the makespan of the
micro-batch schedule its workers run at its batch share: compute, point-to-point
traffic, tied-weight sync and link latencies) plus the slowest stage group's ring
all-reduce of gradients.  Hard constraints: every stage fits its PNode's
memory at its replica's share, `required` colocation groups stay whole, every
replica has at least one sample.  Among plans within 1e-9 of the best step,
the one using fewer PNodes wins.  Throughput is B / step: a slow replica gets
a smaller integer share of the batch so that all replicas finish together.

How
---
1. R = 1 over the whole fleet is the `partition` pass's own plan (min
   bottleneck, then cut); it stays a candidate, so `--replicas auto` never
   predicts a slower step than the single pipeline.
2. For every stage count S (1 .. units, at most `MAX_STAGES`), the units are
   cut into S stages by the same heuristic (`partition_solve.solve`) on S
   identical virtual PNodes (the fleet's median speed; its median and its
   largest bandwidth, since on slow links a cut costs more than it balances;
   its largest memory, and no memory bound at all, since a replica's smaller
   share keeps fewer activations; the layouts check memory): replicas share one cut, so stage s holds the same
   parameters everywhere and all-reduces with its peers.
3. For every replica count R (all up to 24, then a geometric grid) a few
   layouts map R x S slots to PNodes: stage-major (each stage, heaviest in
   memory first, takes the R fastest PNodes that hold it; replica r gets the
   r-th of each, so similar machines form a replica) and replica-major (the
   R x S fastest PNodes in chunks of S, each stage to the fastest PNode of its
   chunk that holds it), by raw speed and by speed-and-bandwidth; with
   regions, also replicas inside a region and stage groups inside a region.
   Batch shares equalise the replicas' finish times (`stepcost.balanced_shares`
   on the simulated pipelines, within each replica's memory).
4. The best plan is improved by a seeded local search that swaps two PNodes
   (or a used one for an idle one) while the predicted step drops.

Pricing a layout simulates every replica's pipeline (vgraph/cost/makespan.py),
so a layout whose `stepcost.step_lower_bound` (the batch spread over the
replicas' busiest stages, plus the all-reduce) cannot beat the best plan so
far is not priced, among the candidates and in the local search alike: the
plan is the one pricing everything finds (tests/test_replica_shares.py), at
about the cost the closed-form bubble had.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass, field
from statistics import median
from typing import Any, Callable, Iterator

import numpy as np

from vgraph.cost.costmodel import DEFAULT_BATCH, CostModel, cost_model
from vgraph.cost.fleet import Fleet, PNode
from vgraph.cost.stepcost import (FleetArrays, StepCost, balanced_shares, batch_shares, bubble, pipeline_seconds,
                                  resident_samples, stage_rates, step_cost_of, step_lower_bound)
from vgraph.cost.tasks import LoadColumns, StageLoads
from vgraph.ir.graph import Graph

from vgraph.passes.partition_plan import Plan, plan_partition
from vgraph.passes.partition_problem import PartitionError, Problem, build_problem
from vgraph.passes.partition_solve import solve

__all__ = ["ReplicaPlan", "plan_replicas", "apply_replica_plan", "candidates", "price_layout", "MAX_STAGES",
           "parse_replicas"]

MAX_STAGES = 64  # stage counts tried (a deeper pipeline than this is never the fastest on volunteer links)
ALL_REPLICA_COUNTS = 24  # every R up to this is tried, then a geometric grid
LOCAL_SEARCH_EVALUATIONS = 300
LOCAL_SEARCH_PATIENCE = 60  # ... stopping after max(this, PNodes / 4) swaps in a row that do not help
SPLIT_ALL_UNITS = 400  # up to this many units every stage count and variant is cut
REL_TIE = 1e-9


def parse_replicas(value: Any) -> int | None:
    """'auto' -> None (the planner chooses), a positive integer -> itself; anything else is an error."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    if isinstance(value, bool):
        raise ValueError(f"replicas must be a positive integer or 'auto', got {value!r}")
    try:
        n = int(str(value).strip()) if not isinstance(value, int) else value
    except ValueError:
        raise ValueError(f"replicas must be a positive integer or 'auto', got {value!r}") from None
    if n < 1 or n > 1_000_000:
        raise ValueError(f"replicas must be between 1 and 1000000 or 'auto', got {value!r}")
    return n


@dataclass
class ReplicaPlan:
    """R replicas of one S-stage pipeline: who runs what, on how many samples, and what it costs."""

    where: np.ndarray  # stage of each VNode, in the cost model's order (`ids`)
    ids: list[str]
    loads: StageLoads
    pnodes: list[list[str]]  # [R][S] PNode ids
    shares: list[int]
    cost: StepCost
    method: str
    base: Plan | None = None  # the partition pass's plan when R = 1 over the whole fleet wins
    pipeline_only: StepCost | None = None  # the partition pass's single pipeline, for comparison
    candidates: int = 0
    seconds: float = 0.0  # planning wall time
    notes: list[str] = field(default_factory=list)

    @property
    def replicas(self) -> int:
        return len(self.pnodes)

    @property
    def stages(self) -> int:
        return len(self.pnodes[0])

    @property
    def stage_of(self) -> dict[str, int]:
        """VNode -> stage."""
        return dict(zip(self.ids, self.where.tolist()))

    def assignment(self, r: int = 0) -> dict[str, str]:
        row = self.pnodes[r]
        return {v: row[s] for v, s in zip(self.ids, self.where.tolist())}

    def summary(self) -> dict[str, Any]:
        """The replica fields of graph.meta["placement"] and placement.json (JSON-compatible)."""
        c = self.cost
        out = {
            "replicas": self.replicas, "stages_per_replica": self.stages, "replica_pnodes": self.pnodes,
            "batch_shares": list(self.shares), "step_seconds": c.step_seconds,
            "pipeline_seconds": c.pipeline_seconds, "allreduce_seconds": c.allreduce_seconds,
            "control_seconds": c.control_seconds, "update_seconds": c.update_seconds, "replica_method": self.method, "plans_compared": self.candidates,
        }
        if self.pipeline_only is not None:
            out["pipeline_only_step_seconds"] = self.pipeline_only.step_seconds
        return out


def plan_replicas(graph: Graph, fleet: Fleet, *, batch: int = DEFAULT_BATCH, micro_batches: int = 1,
                  replicas: int | None = None, cm: CostModel | None = None) -> tuple[ReplicaPlan, CostModel]:
    """The plan of least predicted step time (`replicas=None`: any R; else exactly that R)."""
    t0 = time.perf_counter()
    cm = cm or cost_model(graph, batch=batch, micro_batches=micro_batches)
    fa = FleetArrays(fleet)
    K = len(fleet)
    if replicas is not None and replicas > min(K, batch):
        raise PartitionError(f"{replicas} replicas need {replicas} PNodes and {replicas} samples; the fleet "
                             f"{fleet.name!r} has {K} PNodes and the batch is {batch}")
    best: ReplicaPlan | None = None
    base_error: PartitionError | None = None
    pipeline_only = None
    count = 0
    try:
        base, _ = plan_partition(graph, fleet, batch=batch, micro_batches=micro_batches, cm=cm)
    except PartitionError as exc:
        base, base_error = None, exc
    if base is not None:
        single = _from_partition(base, cm, fa, batch, micro_batches)
        pipeline_only = single.cost
        count += 1
        if replicas == 1:
            single.pipeline_only = pipeline_only
            single.seconds = time.perf_counter() - t0
            return single, cm
        if replicas is None:
            best = single
    def beaten(bound: float) -> bool:  # a plan that cannot beat the best so far is not priced
        return best is not None and bound >= best.cost.step_seconds * (1 + REL_TIE)

    for cand in candidates(graph, fleet, cm, fa, batch, micro_batches, replicas,
                           base.problem if base is not None else None, beaten):
        count += 1
        if cand is not None and (best is None or _better(cand.cost, cand.replicas * cand.stages, best.cost,
                                                         best.replicas * best.stages)):
            best = cand
    if best is None:
        if base_error is not None:
            raise base_error
        raise PartitionError(f"no plan of {replicas} replica(s) fits fleet {fleet.name!r}'s memory at batch "
                             f"{batch} (each replica needs every stage on a PNode that holds it)")
    if best.base is None and not _identical(fa):
        best, tried = _improve(best, fa, batch, micro_batches)
        count += tried
    best.pipeline_only = pipeline_only
    best.candidates = count
    best.seconds = time.perf_counter() - t0
    return best, cm


# -- candidates --------------------------------------------------------------------------------------

def candidates(graph: Graph, fleet: Fleet, cm: CostModel, fa: FleetArrays, batch: int, micro: int,
               replicas: int | None = None, problem: Problem | None = None,
               beaten: Callable[[float], bool] | None = None) -> Iterator[ReplicaPlan | None]:
    """Every (stage cut, replica count, layout) the planner compares, priced; None for a layout that
    cannot hold the batch, or whose step cannot be less than `stepcost.step_lower_bound` when
    `beaten(bound)` says a plan that slow has lost already (branch and bound: pricing simulates every
    replica's pipeline).  (The benchmarks read step time against R from here, without `beaten`.)
    `problem`: the partition pass's unit problem of this graph, if one was built (it is reused when whole
    groups)."""
    cols = LoadColumns(cm)
    for S, where in _splits(graph, fleet, cm, cols, batch, micro, problem):
        loads = cols.loads(where, S)
        for R in _replica_counts(len(fleet), S, batch, replicas):
            for name, idx in _layouts(loads, fa, R, S, batch, micro):
                if beaten is not None and beaten(step_lower_bound(loads, fa, idx, batch)):
                    yield None
                    continue
                priced = price_layout(loads, fa, idx, batch, micro)
                yield None if priced is None else ReplicaPlan(where, cols.ids, loads, _ids(fa, idx), priced[0],
                                                              priced[1], f"{name}, S={S} R={R}")


def _from_partition(plan: Plan, cm: CostModel, fa: FleetArrays, batch: int, micro: int) -> ReplicaPlan:
    """The partition pass's single pipeline as a 1-replica plan (stages in order of use along the chain)."""
    pr = plan.problem
    order: list[int] = []
    for u in range(pr.n):
        p = int(plan.assign[u])
        if p not in order:
            order.append(p)
    stage_of_pnode = np.zeros(pr.k, dtype=np.int64)
    stage_of_pnode[order] = np.arange(len(order))
    cols = LoadColumns(cm)
    unit = np.fromiter((pr.unit_of[v] for v in cols.ids), dtype=np.int64, count=len(cols.ids))
    where = stage_of_pnode[plan.assign[unit]]
    loads = cols.loads(where, len(order))
    idx = np.array([[fa.index[pr.pnodes[p].id] for p in order]], dtype=np.int64)
    cost = step_cost_of(loads, fa, idx, [batch], micro)
    return ReplicaPlan(where, cols.ids, loads, _ids(fa, idx), [batch], cost, f"partition ({plan.method}), R=1",
                       base=plan)


def _splits(graph: Graph, fleet: Fleet, cm: CostModel, cols: LoadColumns, batch: int, micro: int,
            problem: Problem | None = None) -> Iterator[tuple[int, np.ndarray]]:
    """(S, stage of each VNode) for each distinct cut of the network into S stages on identical PNodes.

    The unit problem is built once (it is most of the cost on a large network) and re-targeted at S
    virtual PNodes for every S; a network of more than SPLIT_ALL_UNITS units tries a geometric set
    of stage counts and two (bandwidth, memory) variants instead of every one."""
    flops = median(p.flops for p in fleet)
    bandwidths = sorted({median(p.bandwidth for p in fleet), max(p.bandwidth for p in fleet)})
    memories = (2 ** 62, max(p.memory for p in fleet))  # unbounded (shares shrink activations); the largest PNode
    if problem is not None and problem.view == "groups":
        base = problem
    else:
        typical = min(fleet, key=lambda p: abs(p.flops - flops))  # a probe's per-kind figures, if any
        one = Fleet("stages", (PNode("stage0", memories[1], flops, bandwidths[0], efficiency=typical.efficiency),))
        base = build_problem(graph, one, batch=batch, micro_batches=micro, cm=cm, view="groups")
    unit = np.fromiter((base.unit_of[v] for v in cols.ids), dtype=np.int64, count=len(cols.ids))
    top = min(len(fleet), MAX_STAGES, base.n)
    if base.n <= SPLIT_ALL_UNITS:
        counts = list(range(1, top + 1))
        variants = list(itertools.product(bandwidths, memories))
    else:
        counts = sorted({c for c in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if c <= top} | {top})
        variants = [(bandwidths[0], memories[0]), (bandwidths[-1], memories[1])]
    seen: set[tuple[int, ...]] = set()
    for S in counts:
        fits: set[float] = set()  # bandwidths whose unbounded cut already fits the largest PNode
        for bandwidth, memory in variants:
            if memory == memories[1] and bandwidth in fits:
                continue  # the bounded cut would be the same
            problem = _retarget(base, [PNode(f"stage{i}", memory, flops, bandwidth) for i in range(S)], cm)
            try:
                assign, _ = solve(problem, local_search=False)  # identical PNodes: the exact split is the cut
            except PartitionError:
                continue
            if memory == memories[0] and np.bincount(assign, weights=problem.memory).max() <= memories[1]:
                fits.add(bandwidth)
            order: list[int] = []
            for u in range(problem.n):
                if int(assign[u]) not in order:
                    order.append(int(assign[u]))
            key = tuple(order.index(int(a)) for a in assign)
            if key in seen:
                continue
            seen.add(key)
            yield len(order), np.asarray(key, dtype=np.int64)[unit]


def _retarget(base: Problem, pnodes: list[PNode], cm: CostModel) -> Problem:
    """`base` (built for any fleet) on `pnodes`: only the resident activations depend on the stage count."""
    resident = cm.resident_samples(len(pnodes))
    breakdown = base.breakdown.copy()
    breakdown[:, 3] *= resident / base.resident_samples
    return dataclasses.replace(base, pnodes=pnodes, breakdown=breakdown, memory=breakdown.sum(axis=1),
                               resident_samples=resident)


def _replica_counts(K: int, S: int, batch: int, fixed: int | None) -> list[int]:
    top = min(K // S, batch)
    if fixed is not None:
        return [fixed] if fixed <= top else []
    if top <= ALL_REPLICA_COUNTS:
        return list(range(1, top + 1))
    grid = set(range(1, ALL_REPLICA_COUNTS + 1))
    x = float(ALL_REPLICA_COUNTS)
    while x < top:
        grid.add(int(x))
        x *= 1.15
    grid.add(top)
    return sorted(grid)


def _layouts(loads: StageLoads, fa: FleetArrays, R: int, S: int, batch: int, micro: int
             ) -> Iterator[tuple[str, np.ndarray]]:
    """Candidate maps of R x S slots to PNodes (fleet indices), each as [R, S]."""
    share = math.ceil(batch / R)
    need = loads.static_bytes + loads.activation_bytes * resident_samples(share, micro, S)
    fits = fa.memory[:, None] >= need[None, :]  # [K, S]
    usable = fits.any(axis=1)
    if usable.sum() < R * S:
        return
    keys = {"speed": fa.flops, "speed+bandwidth": fa.balanced}
    for name, key in keys.items():
        order = np.argsort(-key, kind="stable")
        idx = _stage_major(order, fits, R, S, need)
        if idx is not None:
            yield f"stage-major by {name}", idx
        idx = _replica_major(order[usable[order]], fits, R, S, need, fa.flops)
        if idx is not None:
            yield f"replica-major by {name}", idx
    if fa.regions > 1:
        power = np.bincount(fa.region, weights=fa.flops, minlength=fa.regions)
        rank = np.argsort(np.argsort(-power))[fa.region]
        order = np.lexsort((-fa.flops, rank))
        idx = _replica_major(order[usable[order]], fits, R, S, need, fa.flops)
        if idx is not None:
            yield "replicas inside regions", idx
        idx = _stage_groups_in_regions(fa, fits, R, S, need)
        if idx is not None:
            yield "stage groups inside regions", idx


def _stage_major(order: np.ndarray, fits: np.ndarray, R: int, S: int, need: np.ndarray) -> np.ndarray | None:
    used = np.zeros(len(fits), dtype=bool)
    idx = np.empty((R, S), dtype=np.int64)
    for s in np.argsort(-need, kind="stable"):
        chosen = order[fits[order, s] & ~used[order]][:R]
        if len(chosen) < R:
            return None
        used[chosen] = True
        idx[:, s] = chosen
    return idx


def _replica_major(pool: np.ndarray, fits: np.ndarray, R: int, S: int, need: np.ndarray, flops: np.ndarray
                   ) -> np.ndarray | None:
    """Chunks of S consecutive PNodes of `pool` form the replicas; in each, the stage with the most work
    goes to the fastest PNode (a row where that does not fit memory is matched one stage at a time)."""
    if len(pool) < R * S:
        return None
    rows = pool[:R * S].reshape(R, S)
    rows = np.take_along_axis(rows, np.argsort(-flops[rows], axis=1, kind="stable"), axis=1)
    by_work = np.argsort(-need, kind="stable")  # memory need follows the work of a stage closely
    idx = np.empty((R, S), dtype=np.int64)
    idx[:, by_work] = rows
    bad = np.flatnonzero(~fits[idx, np.arange(S)[None, :]].all(axis=1))
    for r in bad:
        chunk = list(rows[r])
        for s in by_work:
            holders = [i for i in chunk if fits[i, s]]
            if not holders:
                return None
            pick = max(holders, key=lambda i: flops[i])
            idx[r, s] = pick
            chunk.remove(pick)
    return idx


def _stage_groups_in_regions(fa: FleetArrays, fits: np.ndarray, R: int, S: int, need: np.ndarray
                             ) -> np.ndarray | None:
    """Each stage's R PNodes from one region where possible (its all-reduce then stays inside it)."""
    used = np.zeros(len(fa.flops), dtype=bool)
    idx = np.empty((R, S), dtype=np.int64)
    order = np.argsort(-fa.flops, kind="stable")
    for s in np.argsort(-need, kind="stable"):
        free = order[fits[order, s] & ~used[order]]
        if len(free) < R:
            return None
        chosen, best = free[:R], -1.0
        for region in range(fa.regions):
            mine = free[fa.region[free] == region]
            if len(mine) >= R and fa.flops[mine[R - 1]] > best:
                chosen, best = mine[:R], float(fa.flops[mine[R - 1]])
        used[chosen] = True
        idx[:, s] = chosen
    return idx


def price_layout(loads: StageLoads, fa: FleetArrays, idx: np.ndarray, batch: int, micro: int
                 ) -> tuple[list[int], StepCost] | None:
    """Batch shares for the layout and its step cost; None when it cannot hold the batch.

    The shares are balanced on the simulated pipelines (`stepcost.balanced_shares`), starting from the
    water-filled shares of the linear model b x bubble x seconds per sample + fixed seconds."""
    R, S = idx.shape
    per_sample, fixed, latency = stage_rates(loads, fa, idx)
    factor = bubble(micro, S)  # a replica's share below M runs fewer micro-batches: a guess only
    a = factor * per_sample.max(axis=1)
    c = fixed.max(axis=1) + latency
    caps = _memory_caps(loads, fa.memory[idx], batch, micro, S)
    guess = batch_shares(batch, a, c, caps)
    if guess is None:
        return None
    if R == 1:
        shares, seconds = guess, None
    else:
        shares, seconds = balanced_shares(lambda rows, b: pipeline_seconds(loads, fa, idx, b, micro, rows=rows),
                                          batch, guess, caps)
    cost = step_cost_of(loads, fa, idx, shares, micro, replica_seconds=seconds)
    return (shares, cost) if cost.fits else None


def _memory_caps(loads: StageLoads, memory: np.ndarray, batch: int, micro: int, S: int) -> np.ndarray:
    """Per replica, the largest share whose stages all fit (0: not even one sample).

    The stages keep resident(b) = ceil(b / m) x min(m, S) samples, m = min(M, b)
    (`stepcost.resident_samples`): every b <= M keeps at most min(M, S), and
    beyond M it grows by min(M, S) every M samples; inverted in closed form.
    """
    free = memory - loads.static_bytes[None, :]
    act = loads.activation_bytes[None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        room = np.where(act > 0, free / np.where(act > 0, act, 1), np.where(free >= 0, np.inf, -1))
    limit = np.minimum(room.min(axis=1), 4.0 * batch)  # resident samples each replica can keep
    m = min(max(1, micro), S)
    cap = np.where(limit >= m, np.floor(limit / m) * max(1, micro), np.floor(limit))
    return np.clip(cap, 0, batch).astype(np.int64)


def _better(a: StepCost, a_used: int, b: StepCost, b_used: int) -> bool:
    if a.step_seconds < b.step_seconds * (1 - REL_TIE):
        return True
    return a.step_seconds <= b.step_seconds * (1 + REL_TIE) and a_used < b_used


def _identical(fa: FleetArrays) -> bool:
    """Every PNode alike (and one region): swapping PNodes cannot change a plan's cost."""
    return (np.ptp(fa.flops) == 0 and np.ptp(fa.bandwidth) == 0 and np.ptp(fa.memory) == 0
            and fa.regions <= 1)


def _ids(fa: FleetArrays, idx: np.ndarray) -> list[list[str]]:
    return [[fa.pnodes[int(i)].id for i in row] for row in idx]


def _improve(plan: ReplicaPlan, fa: FleetArrays, batch: int, micro: int) -> tuple[ReplicaPlan, int]:
    """Seeded local search: swap two slots' PNodes, or a slot's PNode for an idle one, while the step drops."""
    idx = np.array([[fa.index[p] for p in row] for row in plan.pnodes], dtype=np.int64)
    R, S = idx.shape
    K = len(fa.pnodes)
    rng = np.random.default_rng(0)
    best_cost, best_shares = plan.cost, plan.shares
    tried = 0
    improved = False
    since, patience = 0, max(LOCAL_SEARCH_PATIENCE, K // 4)
    for _ in range(LOCAL_SEARCH_EVALUATIONS):
        if since >= patience:
            break
        since += 1
        trial = idx.copy()
        r1, s1 = int(rng.integers(R)), int(rng.integers(S))
        if K > R * S and rng.random() < 0.5:
            idle = np.setdiff1d(np.arange(K), idx.ravel(), assume_unique=False)
            trial[r1, s1] = int(rng.choice(idle))
        else:
            r2, s2 = int(rng.integers(R)), int(rng.integers(S))
            trial[r1, s1], trial[r2, s2] = trial[r2, s2], trial[r1, s1]
        tried += 1
        if step_lower_bound(plan.loads, fa, trial, batch) >= best_cost.step_seconds * (1 - REL_TIE):
            continue  # cannot drop the step: not priced
        cand = price_layout(plan.loads, fa, trial, batch, micro)
        if cand is not None and cand[1].step_seconds < best_cost.step_seconds * (1 - REL_TIE):
            idx, best_shares, best_cost = trial, cand[0], cand[1]
            improved = True
            since = 0
    if not improved:
        return plan, tried
    return ReplicaPlan(plan.where, plan.ids, plan.loads, _ids(fa, idx), best_shares, best_cost,
                       plan.method + " + local search"), tried


def apply_replica_plan(graph: Graph, plan: ReplicaPlan, cm: CostModel, fleet: Fleet) -> int:
    """Place replica 0 on the graph (node.meta["pnode"]) and record the whole plan in graph.meta["placement"]:
    the one-pipeline fields for every replica's PNodes at its share (as vgraph/placement/replica_report.py prices a
    placement.json), plus the replica fields; returns how many VNodes changed PNode."""
    changed = 0
    for v, pid in plan.assignment(0).items():
        meta = graph.node(v).meta
        if meta.get("pnode") != pid:
            meta["pnode"] = pid
            changed += 1
    c, loads = plan.cost, plan.loads
    vnodes = np.bincount(plan.where, minlength=plan.stages)
    pnodes: dict[str, dict[str, Any]] = {}
    for r, row in enumerate(plan.pnodes):
        for s, pid in enumerate(row):
            p = fleet.pnode(pid)
            compute = plan.shares[r] * float(loads.flops[s]) / p.flops
            seconds = float(c.stage_seconds[r, s])
            pnodes[pid] = {"replica": r, "stage": s, "vnodes": int(vnodes[s]), "batch_share": plan.shares[r],
                           "memory_bytes": int(c.memory[r, s]), "capacity_bytes": int(p.memory),
                           "flops_per_step": plan.shares[r] * float(loads.flops[s]),
                           "boundary_bytes_per_step": float(plan.shares[r] * loads.p2p[s].sum() + loads.sync[s].sum()),
                           "compute_seconds": compute, "comm_seconds": seconds - compute, "seconds": seconds}
    bottleneck = max(pnodes, key=lambda pid: pnodes[pid]["seconds"])
    stage = dict(zip(plan.ids, plan.where.tolist()))
    row0 = plan.pnodes[0]
    sync = [{"alias": t.alias, "publisher": t.publisher, "user": t.user, "from_pnode": row0[stage[t.publisher]],
             "to_pnode": row0[stage[t.user]], "bytes_per_step": t.sync_bytes_per_step}
            for t in cm.ties if stage[t.publisher] != stage[t.user]]
    graph.meta["placement"] = {
        "fleet": fleet.name, "batch": cm.batch, "micro_batches": cm.micro_batches, "view": "groups",
        "method": plan.method, "stages": row0, "bottleneck_seconds": pnodes[bottleneck]["seconds"],
        "bottleneck_pnode": bottleneck, "cut_bytes_per_step": float(c.p2p_bytes.sum()), "pnodes": pnodes,
        "weight_sync": sync, **plan.summary(),
    }
    return changed
