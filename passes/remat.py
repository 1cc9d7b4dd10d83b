"""remat: choose which activations are recomputed in backward instead of kept, under a memory budget.

Why a pass: at 2K context the activations of a training step outgrow a 16 GiB
PNode long before the weights do; recomputing some of them in backward trades
FLOPs for memory.  Which ones is a placement-like decision (it depends on the
PNode's memory and on what else it holds), so it belongs next to the cost
model and the partitioner, not in the training script.

What it writes: `remat: recompute` in the config of each VNode whose outputs
are recomputed (absent: kept); vgraph/cost/remat.py defines what the marks cost and
how a backend honours them.  The network computes the same function, so the
pass preserves semantics.

The policy, per scope (each PNode of a partitioned graph, else the whole
graph) and per colocation group:

1. *candidates*: VNodes of a group whose every reader is in the same group
   (and on the same PNode), that no endpoint names, that are not losses and
   feed no loss (the loss kernels keep their own memory plan);
2. *a menu per group*: starting from "keep everything", greedily add the
   candidate that frees the most kept bytes per FLOP it makes backward run
   again (cheap elementwise outputs first, since a matmul's output is costly
   to rebuild), and finally "every candidate recomputed" (the block input kept,
   its interior recomputed); each step is one menu entry (marks, kept bytes,
   bytes rebuilt at once, recompute FLOPs);
3. *the choice*: for each cap on the bytes rebuilt at once (backward rebuilds
   one region at a time, so the peak adds the largest), start every group at
   its cheapest entry under the cap and move the group whose next entry on its
   lower convex hull frees bytes at the lowest FLOP price until the scope
   fits; keep the cheapest result over all caps.

`remat_ilp.py` solves the same problem exactly (small graphs) to measure the gap.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from vgraph.cost.costmodel import DEFAULT_BATCH, CostModel, cost_model
from vgraph.cost.fleet import human_bytes, parse_bytes
from vgraph.cost.host_memory import available_host_memory
from vgraph.cost.remat import (RECOMPUTE, REMAT_KEY, candidates, closed, plain_activation, pnode_static_bytes,
                               remat_cost, remat_layout)
from vgraph.ir.graph import Graph
from vgraph.transform.pass_api import Option, Pass, PassContext, PassError

__all__ = ["Remat", "RematScope", "Entry", "parse_budget", "scopes_of", "plan_scope", "group_menu",
           "candidates", "closed", "apply_marks"]


def parse_budget(text: str) -> int | None:
    """'auto' -> None; a size ('16GiB', '512MB', '1073741824') -> bytes; anything else: ValueError."""
    if not isinstance(text, str):
        raise ValueError(f"expected auto or a size like 16GiB, got {text!r}")
    if text.strip().lower() == "auto":
        return None
    value = parse_bytes(text)
    if value < 1:
        raise ValueError(f"expected a positive size like 16GiB, got {text!r}")
    return value


@dataclass(frozen=True)
class Entry:
    """One way to remat a group: its marks and what they cost per sample."""

    marks: frozenset[str]
    kept: int
    transient: int
    flops: int


@dataclass
class RematScope:
    """VNodes that share one memory (a PNode, or the whole graph) and what that memory must hold."""

    name: str
    ids: list[str]
    capacity: int  # bytes
    static_bytes: int  # parameters, gradients, optimizer state, tied-weight replicas
    resident: int  # samples whose activations are kept at once

    @property
    def per_sample(self) -> float:
        """Activation bytes per resident sample the capacity leaves (negative: the weights alone overflow)."""
        return (self.capacity - self.static_bytes) / self.resident


MENU_SIZE = 48  # Pareto entries kept per group while the menu is built
ALL_SUBSETS = 12  # groups with at most this many candidates get every subset evaluated


def group_menu(graph: Graph, members: Sequence[str], cands: Sequence[str], act: Mapping[str, int],
               flops: Mapping[str, int]) -> list[Entry]:
    """The Pareto menu of one group: (kept, rebuilt-at-once, recompute FLOPs) over subsets of its candidates.

    Small groups try every subset; larger ones are built one candidate at a time (each entry with and
    without it), keeping the non-dominated entries (at most MENU_SIZE, the cheapest per byte kept when
    more); "every candidate" is always an entry.
    """
    order = [n for n in graph.topo_order() if n.id in set(members)]
    ends = {ep.node for ep in graph.iter_endpoints()}
    cache: dict[frozenset[str], Entry] = {}

    def evaluate(marks: frozenset[str]) -> Entry:
        marks = closed(graph, marks)
        e = cache.get(marks)
        if e is None:
            cost = remat_cost(remat_layout(graph, marks, order=order, endpoint_nodes=ends), act, flops, members)
            e = cache[marks] = Entry(marks, cost.kept_bytes, cost.transient_bytes, cost.recompute_flops)
        return e

    if len(cands) <= ALL_SUBSETS:  # small groups: every subset (the cost is not additive over candidates)
        import itertools

        every = [evaluate(frozenset(sub)) for k in range(len(cands) + 1)
                 for sub in itertools.combinations(cands, k)]
        return sorted(_pareto(every), key=lambda e: (-e.kept, e.flops))
    front = [evaluate(frozenset())]
    for c in cands:
        grown = front + [evaluate(e.marks | {c}) for e in front]
        front = _pareto(grown)
        if len(front) > MENU_SIZE:
            base = front[0]
            front.sort(key=lambda e: (e.flops - base.flops) / max(base.kept - e.kept, 1) if e.kept < base.kept
                       else 0.0)
            front = _pareto(front[:MENU_SIZE])
    full = evaluate(frozenset(cands))
    if all(e.marks != full.marks for e in front):
        front.append(full)
    return sorted(front, key=lambda e: (-e.kept, e.flops))


def _pareto(entries: Sequence[Entry]) -> list[Entry]:
    """The entries no other beats on kept bytes, rebuilt bytes and FLOPs at once (first of equals)."""
    out: list[Entry] = []
    seen: set[tuple[int, int, int]] = set()
    for e in sorted(entries, key=lambda e: (e.flops, e.kept, e.transient)):
        key = (e.kept, e.transient, e.flops)
        if key in seen:
            continue
        if any(o.kept <= e.kept and o.transient <= e.transient and o.flops <= e.flops for o in out):
            continue
        seen.add(key)
        out.append(e)
    return out


def _hull(menu: Sequence[Entry]) -> list[Entry]:
    """The entries on the lower convex hull of (kept bytes descending, FLOPs ascending)."""
    pts = sorted(menu, key=lambda e: (-e.kept, e.flops))
    hull: list[Entry] = []
    for e in pts:
        if hull and e.flops >= hull[-1].flops and e.kept >= hull[-1].kept:
            continue
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b is above the segment a-e: drop it
            if (b.flops - a.flops) * (a.kept - e.kept) >= (e.flops - a.flops) * (a.kept - b.kept):
                hull.pop()
            else:
                break
        hull.append(e)
    return hull


EXHAUSTIVE = 20000  # combinations of group entries tried one by one below this count


def choose(menus: Mapping[str, Sequence[Entry]], fixed_kept: int, allowed: float
           ) -> tuple[dict[str, Entry], float] | None:
    """Per group one entry: least total FLOPs with kept + largest transient <= `allowed` (None if none).

    Few combinations (small graphs) are all tried; otherwise, per cap on the rebuilt bytes, groups
    move along their lower convex hulls, cheapest FLOPs per freed byte first, then each group tries
    every entry that lowers the FLOPs and still fits.
    """
    if math.prod(len(m) for m in menus.values()) <= EXHAUSTIVE:
        return _exhaustive(menus, fixed_kept, allowed)
    caps = sorted({e.transient for menu in menus.values() for e in menu})
    best: tuple[dict[str, Entry], float] | None = None
    for cap in caps:
        hulls = {g: _hull([e for e in menu if e.transient <= cap]) for g, menu in menus.items()}
        if any(not h for h in hulls.values()):
            continue
        pos = {g: 0 for g in hulls}
        kept = fixed_kept + sum(h[0].kept for h in hulls.values())
        room = allowed - cap
        while kept > room:
            move, price = None, math.inf
            for g, h in hulls.items():
                i = pos[g]
                if i + 1 < len(h):
                    p = (h[i + 1].flops - h[i].flops) / max(h[i].kept - h[i + 1].kept, 1)
                    if p < price:
                        move, price = g, p
            if move is None:
                break
            kept -= hulls[move][pos[move]].kept - hulls[move][pos[move] + 1].kept
            pos[move] += 1
        if kept > room:
            continue
        pick = {g: hulls[g][pos[g]] for g in hulls}
        for g, menu in menus.items():  # polish: a cheaper entry of one group that still fits
            for e in sorted(menu, key=lambda e: e.flops):
                if e.flops >= pick[g].flops:
                    break
                if e.transient <= cap and kept - pick[g].kept + e.kept <= room:
                    kept += e.kept - pick[g].kept
                    pick[g] = e
                    break
        total = sum(e.flops for e in pick.values())
        if best is None or total < best[1]:
            best = (pick, total)
    return best


def _exhaustive(menus: Mapping[str, Sequence[Entry]], fixed_kept: int, allowed: float
                ) -> tuple[dict[str, Entry], float] | None:
    import itertools

    groups = list(menus)
    best = None
    for combo in itertools.product(*(menus[g] for g in groups)):
        kept = fixed_kept + sum(e.kept for e in combo) + max((e.transient for e in combo), default=0)
        if kept > allowed:
            continue
        total = sum(e.flops for e in combo)
        if best is None or total < best[1]:
            best = (dict(zip(groups, combo)), total)
    return best


def scopes_of(graph: Graph, cm: CostModel, budget: int | None, device_memory: int | None) -> list[RematScope]:
    """One scope per PNode of a partitioned graph (capacity: the PNode's memory or `budget`), else one."""
    placement = graph.meta.get("placement") or {}
    pnodes = placement.get("pnodes") or {}
    where = {n.id: n.meta.get("pnode") for n in graph.nodes}
    if pnodes and all(where.values()):
        stages = max(1, len(placement.get("stages") or [None]))
        resident = cm.resident_samples(stages)
        out = []
        for pid, info in pnodes.items():
            ids = [nid for nid, p in where.items() if p == pid]
            if not ids:
                continue
            static_bytes = pnode_static_bytes(cm, ids, where, pid)
            cap = budget if budget is not None else int(info["capacity_bytes"])
            out.append(RematScope(f"PNode {pid!r}", ids, cap, static_bytes, resident))
        return out
    cap = budget if budget is not None else device_memory if device_memory is not None else available_host_memory()[0]
    if cap is None:
        raise PassError("pass 'remat': budget=auto found no memory to plan for (no placement, no device memory, "
                        "no /proc/meminfo); give budget=SIZE, e.g. remat{budget=16GiB}")
    ids = list(cm.node_columns["id"])
    return [RematScope("the network", ids, cap, pnode_static_bytes(cm, ids, where, None), cm.resident_samples())]


def plan_scope(graph: Graph, cm: CostModel, scope: RematScope, where: Mapping[str, str | None]
               ) -> tuple[frozenset[str], Entry | None, int]:
    """(marks, the chosen totals or None if nothing fits, the per-sample bytes allowed) of one scope."""
    act = plain_activation(cm)
    flops = dict(zip(cm.node_columns["id"], cm.node_columns["flops"]))
    cands = candidates(graph, cm, scope.ids, where)
    groups: dict[str, list[str]] = {}
    for nid in scope.ids:
        g = graph.node(nid).group
        if g in cands:
            groups.setdefault(g, []).append(nid)
    in_groups = {nid for members in groups.values() for nid in members}
    fixed_kept = sum(act[nid] for nid in scope.ids if nid not in in_groups)
    allowed = scope.per_sample
    keep_all = fixed_kept + sum(act[nid] for nid in in_groups)
    if keep_all <= allowed:
        return frozenset(), Entry(frozenset(), keep_all, 0, 0), int(allowed)
    menus = {g: group_menu(graph, members, cands[g], act, flops) for g, members in groups.items()}
    picked = choose(menus, fixed_kept, allowed)
    if picked is None:
        most = {g: m[-1] for g, m in menus.items()}
        kept = fixed_kept + sum(e.kept for e in most.values())
        peak = kept + max((e.transient for e in most.values()), default=0)
        return frozenset().union(*(e.marks for e in most.values())), None, int(peak)
    pick, total = picked
    marks = frozenset().union(*(e.marks for e in pick.values()))
    kept = fixed_kept + sum(e.kept for e in pick.values())
    return marks, Entry(marks, kept, max((e.transient for e in pick.values()), default=0), int(total)), int(allowed)


def apply_marks(graph: Graph, marks: frozenset[str], ids: Iterable[str]) -> int:
    """Set `remat: recompute` on `marks` and remove it from the other VNodes of `ids`; returns changes."""
    changed = 0
    for nid in ids:
        node = graph.node(nid)
        want = RECOMPUTE if nid in marks else None
        if node.config.get(REMAT_KEY) != want:
            node.set_config(**{REMAT_KEY: want})
            changed += 1
    return changed


def _budget(text: str) -> str:
    parse_budget(text)
    return text


_budget.__name__ = "size"


class Remat(Pass):
    """Recompute activations in backward instead of keeping them, where a memory budget needs it."""

    name = "remat"
    preserves_semantics = True  # the same function: some values are computed twice instead of kept
    after = ("dead-nodes", "precision", "fuse-heads", "fuse-lm-head-ce", "partition")
    options = {
        "budget": Option(_budget, "auto", "memory per PNode: auto (each PNode's memory after partition, else the "
                                          "device's, else this machine's available memory) or a size (16GiB)"),
        "batch": Option(int, None, "samples per training step (default: the placement's, else 8)", min=1,
                        max=2**40),
        "micro_batches": Option(int, None, "micro-batches per step (default: the placement's, else 1)", min=1,
                                max=2**40),
    }

    def run(self, graph: Graph, ctx: PassContext) -> Counter:
        budget = parse_budget(self.opts["budget"])
        placement = graph.meta.get("placement") or {}
        # With data-parallel replicas each PNode trains its replica's share of the batch; every replica
        # runs the same network (VNode meta["pnode"] is replica 0's), so plan for the largest share.
        shares = placement.get("batch_shares") or []
        batch = (self.opts["batch"] or (max(shares) if shares else None) or placement.get("batch")
                 or ctx.data.get("batch") or DEFAULT_BATCH)
        micro = self.opts["micro_batches"] or placement.get("micro_batches") or 1
        cm = cost_model(graph, batch=int(batch), micro_batches=int(micro))
        where = {n.id: n.meta.get("pnode") for n in graph.nodes}
        counts: Counter = Counter()
        notes = []
        for scope in scopes_of(graph, cm, budget, ctx.data.get("device_memory")):
            marks, chosen, allowed = plan_scope(graph, cm, scope, where)
            if chosen is None:
                need = scope.static_bytes + allowed * scope.resident
                raise PassError(
                    f"pass 'remat': {scope.name} needs {human_bytes(need)} at batch {batch} even with every "
                    f"candidate recomputed ({len(marks)} VNodes), more than its {human_bytes(scope.capacity)} "
                    f"(weights, gradients and optimizer state alone: {human_bytes(scope.static_bytes)}); lower "
                    f"the batch, add micro-batches or PNodes")
            counts["marked"] += apply_marks(graph, marks, scope.ids)
            counts["recomputed"] += len(marks)
            peak = scope.static_bytes + (chosen.kept + chosen.transient) * scope.resident
            notes.append(f"{scope.name}: " + (
                f"fits without remat ({human_bytes(peak)} of {human_bytes(scope.capacity)})" if not marks else
                f"{len(marks)} VNodes recomputed, {human_bytes(peak)} of {human_bytes(scope.capacity)}, "
                f"+{chosen.flops / max(1, sum(cm.node_columns['flops'])):.1%} forward FLOPs in backward"))
        ctx.notes.append(f"remat (batch {batch}): " + "; ".join(notes))
        return counts
