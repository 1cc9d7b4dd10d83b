"""Export part of a network (one PNode's VNodes, or any set) as its own ONNX model.

A part's boundary tensors are graph inputs and outputs named after the value
that crosses the cut, ``"<producer vnode>:<slot>"``, the same name on both
sides, so running the parts one after the other, handing each one the values
the earlier ones produced, gives the whole network's result.

A partition need not be runnable as one call per part: the production
colocation groups put the embedder and the LM head on one PNode with the
transformer blocks in between, so that PNode's work is two calls (before and
after the blocks).  :func:`runnable_pieces` splits the parts into such pieces (one
per part whenever the parts depend on each other without a cycle), in an
order that can be run front to back.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from vgraph import Graph, VGraphError
from vgraph.ir.depth import graph_depths

from .lower import OPSET, build_model
from .names import BATCH_DIM, input_name, value_name

__all__ = ["Boundary", "Piece", "boundary", "export_subgraph", "assignment_from_meta",
           "assignment_by_group", "split_topological", "runnable_pieces", "export_pieces", "run_in_sequence"]


@dataclass(frozen=True)
class Boundary:
    """What crosses the edge of a node set.

    ``inputs``: values produced outside and read inside, as (producer, slot);
    ``network_inputs``: unconnected input slots inside, as (node, slot);
    ``outputs``: values produced inside and read outside or named by the
    network's outputs/costs, as (producer, slot).
    """

    inputs: tuple[tuple[str, int], ...]
    network_inputs: tuple[tuple[str, int], ...]
    outputs: tuple[tuple[str, int], ...]

    @property
    def input_names(self) -> list[str]:
        return [value_name(*v) for v in self.inputs] + [input_name(*v) for v in self.network_inputs]

    @property
    def output_names(self) -> list[str]:
        return [value_name(*v) for v in self.outputs]


def boundary(graph: Graph, node_ids: Iterable[str]) -> Boundary:
    """The boundary of ``node_ids`` in ``graph`` (deterministic order: topological, then slot)."""
    ids = set(node_ids)
    missing = ids - {n.id for n in graph.nodes}
    if missing:
        raise VGraphError(f"no such VNode(s) in network {graph.name!r}: {', '.join(sorted(missing))}")
    endpoints = {(ep.node, ep.slot) for ep in [*graph.outputs, *graph.costs]}
    inputs: dict[tuple[str, int], None] = {}
    network_inputs: list[tuple[str, int]] = []
    outputs: dict[tuple[str, int], None] = {}
    for n in graph.topo_order():
        if n.id not in ids:
            continue
        for slot in range(graph.num_inputs(n.id)):
            edge = graph.input_edge(n.id, slot)
            if edge is None:
                network_inputs.append((n.id, slot))
            elif edge.src not in ids:
                inputs[(edge.src, edge.src_slot)] = None
        for slot in range(n.num_outputs):
            read_outside = any(e.dst not in ids for e in graph.users(n.id, slot))
            if read_outside or (n.id, slot) in endpoints:
                outputs[(n.id, slot)] = None
    return Boundary(tuple(inputs), tuple(network_inputs), tuple(outputs))


def export_subgraph(
    graph: Graph,
    node_ids: Iterable[str],
    weights: Mapping[str, np.ndarray] | None = None,
    *,
    name: str | None = None,
    batch_dim: str = BATCH_DIM,
    opset: int = OPSET,
) -> onnx.ModelProto:
    """ONNX model of ``node_ids`` alone, its boundary tensors as named inputs and outputs.

    Tied weights are copied into every part that reads them (a part is a
    self-contained file for its PNode).
    """
    ids = list(dict.fromkeys(node_ids))
    if not ids:
        raise VGraphError("cannot export an empty set of VNodes")
    b = boundary(graph, ids)
    docs = {v: "boundary tensor" for v in b.outputs}
    for ep in graph.outputs:
        docs[(ep.node, ep.slot)] = f"output {ep.name!r}"
    for ep in graph.costs:
        docs[(ep.node, ep.slot)] = f"cost {ep.name!r}"
    model = build_model(graph, ids, weights=weights, outputs=list(b.outputs), output_docs=docs,
                        batch_dim=batch_dim, opset=opset, model_name=name or f"{graph.name} part")
    onnx.helper.set_model_props(model, {"vgraph.network": graph.name, "vgraph.vnodes": ",".join(ids),
                                        "vgraph.compute_dtype": "float32"})
    return model


# ---------------------------------------------------------------------------
# Where parts come from
# ---------------------------------------------------------------------------


def assignment_from_meta(graph: Graph, key: str = "pnode") -> dict[str, str]:
    """node id -> part, from the partition pass's ``node.meta[key]``; every node must have one."""
    out, missing = {}, []
    for n in graph.nodes:
        if key in n.meta:
            out[n.id] = str(n.meta[key])
        else:
            missing.append(n.id)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise VGraphError(f"{len(missing)} VNode(s) have no meta[{key!r}] (not partitioned?): {shown}")
    return out


def assignment_by_group(graph: Graph) -> dict[str, str]:
    """node id -> colocation group (a node without a group is its own part)."""
    return {n.id: n.group or n.id for n in graph.nodes}


def split_topological(graph: Graph, parts: int) -> dict[str, str]:
    """node id -> "part<i>": ``parts`` contiguous, near-equal chunks of the topological order."""
    order = graph.topo_order()
    if not 1 <= parts <= len(order):
        raise VGraphError(f"cannot split {len(order)} VNodes into {parts} parts")
    return {n.id: f"part{i * parts // len(order)}" for i, n in enumerate(order)}


@dataclass(frozen=True)
class Piece:
    """One runnable call: the nodes of ``part`` at ``depth`` (pieces run in increasing depth).

    ``name`` is the part's name, or ``"<part>@<i>"`` (i-th piece of that
    part, from 0) when a part runs in more than one piece.
    """

    name: str
    part: str
    depth: int
    node_ids: tuple[str, ...]


def runnable_pieces(graph: Graph, assignment: Mapping[str, str]) -> list[Piece]:
    """Split the parts into pieces that can run front to back, and order them.

    If the parts depend on each other without a cycle, each part is one
    piece, in dependency order.  Otherwise a part is cut where a path leaves
    it and comes back (the production LM head shares its PNode with the
    embedder): a node's depth is the largest number of part changes on any
    path into it (`vgraph.ir.depth`, the rule the torch workers cut by), and
    a piece (part, depth) reads only pieces of lower depths, so sorting by
    (depth, first node) is a valid running order.
    """
    order = graph.topo_order()
    missing = [n.id for n in order if n.id not in assignment]
    if missing:
        raise VGraphError(f"VNode(s) in no part: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    position = {n.id: i for i, n in enumerate(order)}
    depth = _part_dag_depths(graph, assignment, order) or graph_depths(graph, assignment)
    groups: dict[tuple[str, int], list[str]] = {}
    for n in order:
        groups.setdefault((assignment[n.id], depth[n.id]), []).append(n.id)
    keys = sorted(groups, key=lambda k: (k[1], position[groups[k][0]]))
    count = Counter(part for part, _ in keys)
    seen: Counter[str] = Counter()
    pieces = []
    for part, s in keys:
        name = part if count[part] == 1 else f"{part}@{seen[part]}"
        seen[part] += 1
        pieces.append(Piece(name, part, s, tuple(groups[(part, s)])))
    return pieces


def _part_dag_depths(graph: Graph, assignment: Mapping[str, str], order) -> dict[str, int] | None:
    """Every node at its part's position in a topological order of the parts; None if they cycle."""
    import networkx as nx

    parts = nx.DiGraph()
    first: dict[str, int] = {}
    for i, n in enumerate(order):
        first.setdefault(assignment[n.id], i)
        parts.add_node(assignment[n.id])
    for e in graph.edges:
        if assignment[e.src] != assignment[e.dst]:
            parts.add_edge(assignment[e.src], assignment[e.dst])
    try:
        ranked = list(nx.lexicographical_topological_sort(parts, key=first.__getitem__))
    except nx.NetworkXUnfeasible:
        return None
    rank = {part: i for i, part in enumerate(ranked)}
    return {n.id: rank[assignment[n.id]] for n in order}




def export_pieces(graph: Graph, pieces: Sequence[Piece],
                  weights: Mapping[str, np.ndarray] | None = None, **kwargs) -> list[onnx.ModelProto]:
    return [export_subgraph(graph, p.node_ids, weights, name=p.name, **kwargs) for p in pieces]


Runner = Callable[[onnx.ModelProto], Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]]


def _ort_runner(model: onnx.ModelProto) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    import onnxruntime as ort

    from .check import providers

    session = ort.InferenceSession(model.SerializeToString(), providers=providers())
    names = [o.name for o in session.get_outputs()]
    return lambda feeds: dict(zip(names, session.run(names, feeds)))


def run_in_sequence(models: Sequence[onnx.ModelProto], feeds: Mapping[str, np.ndarray],
                    runner: Runner = _ort_runner) -> dict[str, np.ndarray]:
    """Run the parts in order, each fed from ``feeds`` and the earlier parts' outputs.

    Returns every value any part produced (boundary tensors and endpoints).
    """
    values: dict[str, np.ndarray] = dict(feeds)
    for model in models:
        wanted = [i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
        missing = [name for name in wanted if name not in values]
        if missing:
            raise VGraphError(f"part {model.graph.name!r} needs {', '.join(missing)}, which no feed or "
                              "earlier part provides (are the parts in running order?)")
        values.update(runner(model)({name: values[name] for name in wanted}))
    return values
