"""dead-nodes: remove VNodes whose results reach no output, cost or metric.

A node stays if an output, cost or metric depends on it, or if it publishes
a weight that a live node ties to (the weight must keep its owner).  A
network with no outputs, costs or metrics at all is left untouched rather
than emptied.
"""
from __future__ import annotations

from collections import Counter

from vgraph.ir.graph import Graph
from vgraph.transform.pass_api import Pass, PassContext


def live_nodes(graph: Graph) -> set[str]:
    """Everything an endpoint depends on, through edges and through weight ties."""
    publishers = graph.publishers()
    inputs = graph.input_index()
    live: set[str] = set()
    todo = [ep.node for ep in graph.iter_endpoints() if ep.node in graph]
    while todo:
        node_id = todo.pop()
        if node_id in live:
            continue
        live.add(node_id)
        todo.extend(e.src for e in inputs[node_id].values())
        node = graph.node(node_id)
        for alias, _ in node.op.tied(node.cfg).values():
            if (pub := publishers.get(alias)) is not None:
                todo.append(pub.id)
    return live


class DeadNodes(Pass):
    """Remove VNodes that reach no output, cost or metric."""

    name = "dead-nodes"
    preserves_semantics = True  # what no endpoint reads cannot change what the network computes

    def run(self, graph: Graph, ctx: PassContext) -> Counter:
        if not any(True for _ in graph.iter_endpoints()):
            ctx.notes.append("dead-nodes: the network has no outputs, costs or metrics; left untouched")
            return Counter()
        live = live_nodes(graph)
        dead = [n.id for n in reversed(graph.topo_order()) if n.id not in live]
        for node_id in dead:
            for e in graph.in_edges(node_id):
                graph.remove_edge(e)
            graph.remove_node(node_id)
        return Counter(removed=len(dead))
