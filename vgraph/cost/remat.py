"""Rematerialisation marks and what they cost: the one model the pass, the cost model and the backends share.

A VNode whose config says `remat: recompute` does not keep its outputs for
backward: they are recomputed from kept tensors when backward needs them.
How a backend does that decides what the marks cost, so the layout is
defined here, once, and the torch lowering follows it exactly:

* **Regions.**  Walking the graph in its topological order, a region is a
  maximal contiguous run of VNodes of one colocation group in which every
  member is marked, or reads an output of a marked member of the run (a
  *frontier* node: its own outputs are kept, but it is re-run in backward to
  rebuild what it saved from its marked inputs).  A contiguous stretch of a
  topological order is convex (no path leaves it and comes back), which is
  what lets a backend cut it out as one checkpointed function whose inputs
  are kept and whose outputs are the values read outside it.
* **Recomputed** VNodes are the marked ones whose every reader is inside
  their region and which no endpoint names: their outputs exist only while
  their region is rebuilt.  A marked VNode read from outside its region, or
  through a kept broadcast (an alias), is in effect kept.
* **Costs** (per sample): kept bytes are the activations of every VNode but
  the recomputed ones; backward rebuilds one region at a time, so the peak
  adds the recomputed bytes of one colocation group's regions, the largest
  such group (`transient`: counted per group rather than per region, an upper
  bound that keeps the model linear, so the ILP oracle solves it exactly); every region
  member runs its forward again (`recompute_flops`), frontier nodes included,
  because a checkpointed function is re-run from its kept inputs.

A broadcast's outputs alias its input (their bytes are free), so the pass
marks a broadcast exactly when its input is marked: keeping an alias would
keep the tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from vgraph.ir.graph import Graph, VNode

REMAT_KEY = "remat"
RECOMPUTE = "recompute"

__all__ = ["NO_REMAT", "candidates", "closed", "plain_activation", "pnode_static_bytes", "REMAT_KEY", "RECOMPUTE", "RematLayout", "RematCost", "is_marked", "remat_layout", "remat_cost",
           "marked_ids"]


def is_marked(node: VNode) -> bool:
    return node.config.get(REMAT_KEY) == RECOMPUTE


def marked_ids(graph: Graph) -> frozenset[str]:
    return frozenset(n.id for n in graph.nodes if is_marked(n))


@dataclass(frozen=True)
class RematLayout:
    regions: tuple[tuple[str, ...], ...]  # members of each region, in topological order
    groups: tuple[object, ...]  # the colocation group of each region
    region_of: Mapping[str, int]
    recomputed: frozenset[str]  # outputs not kept for backward
    reexecuted: frozenset[str]  # every region member: its forward runs again in backward


NO_REMAT = RematLayout((), (), {}, frozenset(), frozenset())


def remat_layout(graph: Graph, marks: frozenset[str] | set[str] | None = None, *,
                 order: list[VNode] | None = None, endpoint_nodes: set[str] | None = None) -> RematLayout:
    """The regions of `graph` under `marks` (default: the VNodes marked in their config).

    `order` restricts the walk to some VNodes in topological order (e.g. one colocation group, whose
    regions never reach outside it); `endpoint_nodes` saves recomputing the set of endpoint VNodes.
    """
    if marks is None:
        marks = marked_ids(graph)
    if not marks:
        return NO_REMAT
    inputs = graph.input_index()
    regions: list[list[str]] = []
    groups: list[object] = []
    run: list[str] = []
    run_marked: set[str] = set()
    run_group: object = None

    def close() -> None:
        if run and run_marked:
            regions.append(list(run))
            groups.append(run_group)
        run.clear()
        run_marked.clear()

    order = graph.topo_order() if order is None else order
    for node in order:
        group = node.config.get("colocate_group")
        same = bool(run) and group == run_group
        reads_marked = same and any(e.src in run_marked for e in inputs[node.id].values())
        if node.id in marks:
            if not same:
                close()
                run_group = group
            run.append(node.id)
            run_marked.add(node.id)
        elif reads_marked:
            run.append(node.id)
        else:
            close()
    close()
    region_of = {nid: i for i, members in enumerate(regions) for nid in members}
    if endpoint_nodes is None:
        endpoint_nodes = {ep.node for ep in graph.iter_endpoints()}
    recomputed: set[str] = set()
    for node in reversed(order):  # readers first: a kept broadcast keeps the tensor it aliases
        nid = node.id
        r = region_of.get(nid)
        if nid not in marks or r is None or nid in endpoint_nodes:
            continue
        if all(region_of.get(e.dst) == r and (e.dst in recomputed or graph.node(e.dst).type != "broadcast")
               for e in graph.out_edges(nid)):
            recomputed.add(nid)
    return RematLayout(tuple(map(tuple, regions)), tuple(groups), region_of, frozenset(recomputed), frozenset(region_of))


@dataclass(frozen=True)
class RematCost:
    """Per sample: bytes kept for backward, the largest region rebuilt at once, FLOPs run again."""

    kept_bytes: int
    transient_bytes: int
    recompute_flops: int

    @property
    def peak_bytes(self) -> int:
        return self.kept_bytes + self.transient_bytes


def remat_cost(layout: RematLayout, activation_bytes: Mapping[str, int], flops: Mapping[str, int],
               ids=None) -> RematCost:
    """The costs of `layout` over VNodes `ids` (default: every VNode of `activation_bytes`)."""
    ids = activation_bytes.keys() if ids is None else ids
    kept = 0
    again = 0
    per_group: dict[object, int] = {}
    for nid in ids:
        size = activation_bytes[nid]
        if nid in layout.recomputed:
            g = layout.groups[layout.region_of[nid]]
            per_group[g] = per_group.get(g, 0) + size
        else:
            kept += size
        if nid in layout.reexecuted:
            again += flops[nid]
    return RematCost(kept, max(per_group.values(), default=0), again)


# -- what may be marked (the pass and `analyze --max-batch` share it) -----------------------------

def closed(graph: Graph, marks: Iterable[str]) -> frozenset[str]:
    """`marks` plus every broadcast whose input is marked (its outputs alias the input)."""
    out = set(marks)
    for node in graph.topo_order():
        if node.type == "broadcast" and node.id not in out:
            e = graph.input_edge(node.id, 0)
            if e is not None and e.src in out:
                out.add(node.id)
    return frozenset(out)


def candidates(graph: Graph, cm, ids: Iterable[str], pnode_of: Mapping[str, str | None]
               ) -> dict[str, list[str]]:
    """Markable VNodes of `ids` by colocation group (see the module docstring)."""
    act = plain_activation(cm)
    endpoint_nodes = {ep.node for ep in graph.iter_endpoints()}
    out: dict[str, list[str]] = {}
    for nid in ids:
        node = graph.node(nid)
        group = node.group
        if group is None or nid in endpoint_nodes or node.op.is_cost or node.type == "broadcast" or not act[nid]:
            continue
        readers = graph.out_edges(nid)
        if not readers:
            continue
        ok = True
        for e in readers:
            dst = graph.node(e.dst)
            if dst.group != group or pnode_of.get(e.dst) != pnode_of.get(nid) or dst.op.is_cost:
                ok = False
                break
        if ok and _independent(graph, _alias_readers(graph, nid), group):
            out.setdefault(group, []).append(nid)
    return out


def _alias_readers(graph: Graph, nid: str) -> set[str]:
    """The VNodes that read `nid`'s tensors, looking through broadcasts (aliases)."""
    out: set[str] = set()
    todo = [e.dst for e in graph.out_edges(nid)]
    while todo:
        v = todo.pop()
        if graph.node(v).type == "broadcast":
            todo.extend(e.dst for e in graph.out_edges(v))
        else:
            out.add(v)
    return out


def _independent(graph: Graph, readers: set[str], group: str) -> bool:
    """No reader reaches another inside the group: the node and its readers can be one checkpointed region.

    (A residual read by a layernorm and by the add that closes the block fails this: the block's
    second half runs between them, so recomputing it would need two regions.)
    """
    for r in readers:
        seen: set[str] = set()
        todo = [e.dst for e in graph.out_edges(r)]
        while todo:
            v = todo.pop()
            if v in seen or graph.node(v).group != group:
                continue
            if v in readers:
                return False
            seen.add(v)
            todo.extend(e.dst for e in graph.out_edges(v))
    return True


def plain_activation(cm) -> dict[str, int]:
    """Per sample activation bytes of every VNode as if nothing were recomputed."""
    c = cm.node_columns
    return {nid: a + r for nid, a, r in zip(c["id"], c["activation_bytes"], c["recompute_bytes"])}


def pnode_static_bytes(cm, ids: Iterable[str], pnode_of: Mapping[str, str | None], pid: str | None) -> int:
    """What a PNode holds whatever the batch: parameters, gradients, optimizer state, tied-weight replicas."""
    t = cm.totals(ids)
    static = t["param_bytes"] + t["grad_bytes"] + t["optimizer_bytes"]
    if pid is not None:
        static += sum(tie.replica_bytes for tie in cm.ties
                      if pnode_of.get(tie.user) == pid and pnode_of.get(tie.publisher) != pid)
    return static
