"""The placement problem of the `partition` pass: units, their costs, and how an assignment scores.

The problem (what the heuristic and the exact ILP oracle both optimise)
-----------------------------------------------------------------------
*Units* are what is placed: a colocation group with policy `required` is one
unit (never split); a VNode without a group is a unit of its own; a group
without `required` (a preference) is one unit too, unless the fleet has more
PNodes than there are units, in which case its VNodes become units (this is
how attention heads spread over PNodes: only when the fleet has more PNodes
than blocks, and only where no `required` group forbids it).  A `kv_head` and
the query heads reading it (grouped-query attention, one VNode per head) are
one unit where no group holds them: they spread as one.

For an assignment of units to PNodes, with the per-step costs of
`vgraph.cost.costmodel` at batch B:

    compute(p)  = sum of training FLOPs (3 x forward x B) of the units on p
    boundary(p) = bytes per step of every cut edge incident to p (activation
                  + gradient), plus 2 x the weight for every tied weight whose
                  publisher and user are on different PNodes (weight sync)
    time(p)     = compute(p) / flops(p) + boundary(p) / bandwidth(p)
    memory(p)   = parameters + gradients + optimizer state + resident
                  activations of its units (+ a replica of a tied weight used
                  away from its publisher) <= memory of p

minimise, in this order, the bottleneck max_p time(p) and then the cut bytes
(each cut edge counted once).  Memory is a hard constraint; an instance with
no feasible assignment is an error naming the unit that does not fit, never
a silent relaxation.

This module is what the heuristic (`partition_solve`) and the exact ILP oracle
(`partition_ilp`) share: they optimise the same `Problem` and are judged by
the same `evaluate`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from vgraph.base.diagnostics import VGraphError
from vgraph.cost.costmodel import DEFAULT_BATCH, CostModel, cost_model
from vgraph.cost.fleet import Fleet, PNode, human_bytes
from vgraph.cost.stepcost import effective_flops
from vgraph.ir.graph import Graph

class PartitionError(VGraphError):
    """No placement satisfies the hard constraints (`unit`: the unit that does not fit, if one)."""

    unit: int | None = None



# -- the problem -----------------------------------------------------------------------------

@dataclass
class Unit:
    name: str  # the colocation group, or the VNode id
    members: list[str]
    kind: str  # "required" | "preferred" | "kv_group" | "vnode"


@dataclass
class Problem:
    """Units in chain order with their costs, the unit graph and the fleet."""

    units: list[Unit]
    pnodes: list[PNode]
    compute: np.ndarray  # FLOPs per step, per unit
    memory: np.ndarray  # bytes, per unit
    breakdown: np.ndarray  # [n, 4]: params, gradients, optimizer state, activations
    edge_p: np.ndarray  # unit edges, p < q (chain positions), sorted by p
    edge_q: np.ndarray
    edge_w: np.ndarray  # bytes per step (both directions of cut edges, weight sync included)
    ties: list[tuple[int, int, int]]  # (publisher unit, user unit, replica bytes)
    unit_of: dict[str, int]
    view: str  # "groups" | "vnodes"
    batch: int
    micro_batches: int
    resident_samples: int

    @property
    def n(self) -> int:
        return len(self.units)

    @property
    def k(self) -> int:
        return len(self.pnodes)

    def speeds(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (np.array([p.flops for p in self.pnodes], dtype=float),
                np.array([p.bandwidth for p in self.pnodes], dtype=float),
                np.array([p.memory for p in self.pnodes], dtype=float))

    def adjacency(self) -> list[list[tuple[int, float]]]:
        adj: list[list[tuple[int, float]]] = [[] for _ in range(self.n)]
        for p, q, w in zip(self.edge_p.tolist(), self.edge_q.tolist(), self.edge_w.tolist()):
            adj[p].append((q, w))
            adj[q].append((p, w))
        return adj


def build_problem(graph: Graph, fleet: Fleet, *, batch: int = DEFAULT_BATCH, micro_batches: int = 1,
                  cm: CostModel | None = None, view: str | None = None) -> Problem:
    """The placement problem of `graph` on `fleet` (see the module docstring).

    `view` forces "groups" (preferred groups stay whole) or "vnodes" (they are
    split); by default the rule of the module docstring picks it.
    """
    cm = cm or cost_model(graph, batch=batch, micro_batches=micro_batches)
    nodes = graph.nodes
    order = _chain_order(graph, nodes)
    required: set[str] = set()
    for n in nodes:
        if n.config.get("colocate_policy") == "required" and n.config.get("colocate_group"):
            required.add(n.config["colocate_group"])
    groups_view = _units(graph, order, required, split_preferred=False)
    preferred = any(u.kind == "preferred" and len(u.members) > 1 for u in groups_view[0])
    if view is None:
        view = "vnodes" if preferred and len(fleet) > len(groups_view[0]) else "groups"
    if view == "groups" or not preferred:
        units, unit_of = groups_view
    else:
        units, unit_of = _units(graph, order, required, split_preferred=True)
    n = len(units)
    stages = len(fleet)  # at most one stage per PNode
    resident = cm.resident_samples(stages)
    ids = cm.node_columns["id"]
    index = np.fromiter((unit_of[nid] for nid in ids), dtype=np.int64, count=len(ids))
    flops = effective_flops(cm, fleet)  # FLOPs, or time in FLOPs of the peak when the fleet was probed
    columns = (cm.column("param_bytes"), cm.column("grad_bytes"), cm.column("master_bytes") + cm.column("adam_bytes"),
               cm.column("activation_bytes").astype(float) * resident)  # float: int64 wraps at batch 1e16
    compute = np.bincount(index, weights=flops, minlength=n)
    breakdown = np.stack([np.bincount(index, weights=col.astype(float), minlength=n) for col in columns], axis=1)
    memory = breakdown.sum(axis=1)
    # unit graph: cut edges aggregated per unit pair, p < q
    src = index[cm.column("edge:src").astype(np.int64)]
    dst = index[cm.column("edge:dst").astype(np.int64)]
    w = cm.edge_round_trip() * cm.batch
    ties: list[tuple[int, int, int]] = []
    for t in cm.ties:
        a, b = unit_of[t.publisher], unit_of[t.user]
        if a != b:
            ties.append((a, b, t.replica_bytes))
            src = np.append(src, a)
            dst = np.append(dst, b)
            w = np.append(w, float(t.sync_bytes_per_step))
    keep = src != dst
    p, q, w = np.minimum(src, dst)[keep], np.maximum(src, dst)[keep], w[keep]
    key = p * n + q
    uniq, inverse = np.unique(key, return_inverse=True)
    weights = np.bincount(inverse, weights=w, minlength=len(uniq))
    return Problem(units, list(fleet.pnodes), compute, memory, breakdown, uniq // n, uniq % n, weights,
                   ties, unit_of, view, cm.batch, cm.micro_batches, resident)


def _chain_order(graph: Graph, nodes: list) -> list[str]:
    """Node ids in a topological order: the file's order when it is one (checked in O(E))."""
    pos = {n.id: i for i, n in enumerate(nodes)}
    for e in graph.edges:
        if pos[e.src] > pos[e.dst]:
            return [n.id for n in graph.topo_order()]
    return list(pos)


def _units(graph: Graph, order: list[str], required: set[str], *, split_preferred: bool
           ) -> tuple[list[Unit], dict[str, int]]:
    vnodes = {n.id: n for n in graph.nodes}
    units: list[Unit] = []
    by_name: dict[str, int] = {}
    unit_of: dict[str, int] = {}
    for nid in order:
        group = vnodes[nid].config.get("colocate_group")
        kv = None if group and (group in required or not split_preferred) else _kv_group(graph, vnodes[nid])
        if kv is not None or group and (group in required or not split_preferred):
            key = "k:" + kv if kv is not None else "g:" + group
            u = by_name.get(key)
            if u is None:
                u = by_name[key] = len(units)
                kind = "kv_group" if kv is not None else "required" if group in required else "preferred"
                units.append(Unit(kv if kv is not None else group, [], kind))
            units[u].members.append(nid)
        else:
            u = len(units)
            units.append(Unit(nid, [nid], "vnode"))
        unit_of[nid] = u
    return units, unit_of


def _kv_group(graph: Graph, node) -> str | None:
    """The kv_head a VNode of per-head grouped-query attention is placed with: itself, or the one a query
    head (kv_input) reads.  A group split over PNodes would send its keys and values over a cut and could
    not be fused (fuse-heads fuses whole groups), so a group is one unit where no colocation group decides."""
    if node.type == "kv_head":
        return node.id
    if node.type == "attention_head" and node.cfg["kv_input"]:
        source = graph.producer(node.id, 1)
        return source.id if source is not None and source.type == "kv_head" else None
    return None


# -- evaluating an assignment ------------------------------------------------------------------

@dataclass
class Evaluation:
    bottleneck: float
    cut: float
    times: np.ndarray
    compute: np.ndarray  # FLOPs per PNode
    boundary: np.ndarray  # bytes per PNode
    memory: np.ndarray  # bytes per PNode
    feasible: bool

    def key(self) -> tuple[float, float]:
        return (self.bottleneck if self.feasible else math.inf, self.cut)


def evaluate(problem: Problem, assign: np.ndarray) -> Evaluation:
    """The objective and the per-PNode loads of `assign` (unit -> PNode index)."""
    F, BW, M = problem.speeds()
    k = problem.k
    compute = np.bincount(assign, weights=problem.compute, minlength=k)
    memory = np.bincount(assign, weights=problem.memory, minlength=k)
    for pub, user, replica in problem.ties:
        if assign[pub] != assign[user]:
            memory[assign[user]] += replica
    ap, aq = assign[problem.edge_p], assign[problem.edge_q]
    cut = ap != aq
    w = problem.edge_w[cut]
    boundary = np.bincount(ap[cut], weights=w, minlength=k) + np.bincount(aq[cut], weights=w, minlength=k)
    times = compute / F + boundary / BW
    feasible = bool(np.all(memory <= M))
    return Evaluation(float(times.max()), float(w.sum()), times, compute, boundary, memory, feasible)


def better(a: tuple[float, float], b: tuple[float, float], tol: float = 1e-9) -> bool:
    """Lexicographically smaller (bottleneck, cut), with a relative tolerance on each."""
    if a[0] < b[0] * (1 - tol) - 1e-300:
        return True
    if a[0] <= b[0] * (1 + tol) + 1e-300:
        return a[1] < b[1] * (1 - tol) - 1e-9
    return False



def infeasible(problem: Problem) -> PartitionError:
    """The error for a problem no assignment fits: the unit too big for any PNode, the fleet too small, or both."""
    largest = max(problem.pnodes, key=lambda p: p.memory)
    names = ("params", "gradients", "optimizer state", "activations")

    def breakdown(u: int) -> str:
        parts = ", ".join(f"{name} {human_bytes(v)}" for name, v in zip(names, problem.breakdown[u]))
        return parts

    where = f"(batch {problem.batch}, activations of {problem.resident_samples} resident samples)"
    u = int(np.argmax(problem.memory))
    unit = problem.units[u]
    if problem.memory[u] > largest.memory:
        what = {"required": f"colocation group {unit.name!r} (colocate_policy: required, "
                            f"{len(unit.members)} VNodes)",
                "preferred": f"colocation group {unit.name!r} ({len(unit.members)} VNodes)",
                "kv_group": f"kv_head {unit.name!r} with its query heads ({len(unit.members)} VNodes)",
                "vnode": f"VNode {unit.name!r}"}[unit.kind]
        msg = (f"{what} needs {human_bytes(problem.memory[u])} {where}: {breakdown(u)}; the largest "
               f"PNode '{largest.id}' has {human_bytes(largest.memory)}, "
               f"{human_bytes(problem.memory[u] - largest.memory)} short")
        err = PartitionError(msg)
        err.unit = u
        return err
    total = float(problem.memory.sum())
    capacity = float(sum(p.memory for p in problem.pnodes))
    sums = problem.breakdown.sum(axis=0)
    parts = ", ".join(f"{name} {human_bytes(v)}" for name, v in zip(names, sums))
    if total > capacity:
        return PartitionError(f"the network needs {human_bytes(total)} {where}: {parts}; the fleet's "
                              f"{problem.k} PNodes have {human_bytes(capacity)} together, "
                              f"{human_bytes(total - capacity)} short")
    return PartitionError(f"no assignment of the {problem.n} units fits the fleet's memory {where}: the "
                          f"network needs {human_bytes(total)} ({parts}) of {human_bytes(capacity)}, and "
                          f"the largest unit, {unit.name!r}, needs {human_bytes(problem.memory[u])} "
                          f"({breakdown(u)}); largest PNode '{largest.id}' has {human_bytes(largest.memory)}")

