"""A VNode's depth in a placed network: how many times the stage changes on the longest path reaching it.

The one rule behind every runnable split of a placed network.  A stage (the VNodes one PNode holds in
a pipeline) cannot always run as one block: the embedder and the tied LM head share a PNode, so that
stage computes the start of the network, waits for the blocks on the other stages, then computes the
end.  Cutting each stage by depth gives blocks that can: an edge between two blocks goes from a lower
depth to a higher one (or stays inside one stage at one depth), so running the blocks by increasing
depth never waits on a later one.  The torch workers' step plan (vgraph/run/step_plan.py), the step
cost model's tasks (vgraph/cost/tasks.py) and the ONNX pieces (backends/onnx/subgraph.py) all cut with
this function; tests/test_depth.py pins it on a hand-made graph.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from vgraph.ir.graph import Graph

__all__ = ["depths", "graph_depths"]

K = TypeVar("K", bound=Hashable)


def depths(order: Iterable[K], preds: Mapping[K, Iterable[K]] | Sequence[Iterable[Any]],
           where: Mapping[K, Hashable] | Sequence[Hashable]) -> dict[K, int]:
    """Per node, the largest number of `where` changes on a path reaching it: 0 where no edge enters,
    else the largest of (producer's depth, plus one when the producer is elsewhere) over its producers.

    `order` is topological (a producer before its users), `preds[v]` the producers of `v` (repeats are
    harmless) and `where[v]` the stage that runs `v`; both are indexed by node, so integer nodes may
    pass lists (the cost model's columns), named ones dicts.
    """
    out: dict[K, int] = {}
    for v in order:
        best = 0
        at = where[v]  # type: ignore[index]
        for u in preds[v]:  # type: ignore[index]
            d = out[u] + (where[u] != at)  # type: ignore[index]
            if d > best:
                best = d
        out[v] = best
    return out


def graph_depths(graph: Graph, assignment: Mapping[str, Hashable]) -> dict[str, int]:
    """VNode id -> depth, for a graph whose VNodes `assignment` places (VNode id -> PNode or part)."""
    order = [n.id for n in graph.topo_order()]
    preds = {v: [e.src for e in graph.in_edges(v)] for v in order}
    return depths(order, preds, assignment)
