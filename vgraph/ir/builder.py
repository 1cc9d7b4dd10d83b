"""A small programmatic way to write networks (generators, tests, plugins).

Config values are given as Python values and normalised through the op's
schema exactly as if they had been read from YAML, so a built graph and the
same graph loaded from its YAML are equal.
"""
from __future__ import annotations

from typing import Any

from vgraph.base.diagnostics import VGraphError
from vgraph.ir.graph import Endpoint, Graph, VNode
from vgraph.ops import REGISTRY
from vgraph.ops.schema import Field


class NetBuilder:
    def __init__(self, name: str, **attrs: Any) -> None:
        self.graph = Graph(name)
        for key, value in attrs.items():
            self.graph.attrs[key] = Field("precision", "precision").parse(str(value))

    def node(self, node_id: str, type_name: str, **config: Any) -> str:
        op = REGISTRY.get(type_name)
        raw = {k: Field.format(v) for k, v in config.items() if v is not None}
        values, problems = op.schema.parse(raw)
        if problems:
            raise VGraphError("; ".join(f"node '{node_id}': {msg}" for _, msg in problems))
        self.graph.add_node(VNode(node_id, op.name, values))
        return node_id

    def edge(self, src: str, dst: str, src_slot: int = 0, dst_slot: int = 0) -> None:
        self.graph.add_edge(src, src_slot, dst, dst_slot)

    def chain(self, *ids: str) -> str:
        for a, b in zip(ids, ids[1:]):
            self.edge(a, b)
        return ids[-1]

    def output(self, name: str, node: str, slot: int = 0) -> None:
        self.graph.add_endpoint("outputs", Endpoint(name, node, slot))

    def cost(self, name: str, node: str, slot: int = 0) -> None:
        self.graph.add_endpoint("costs", Endpoint(name, node, slot))

    def metric(self, name: str, node: str, slot: int = 0, type: str = "learning_rate") -> None:
        self.graph.add_endpoint("metrics", Endpoint(name, node, slot, type))

    def build(self, *, verify: bool = True) -> Graph:
        if verify:
            from vgraph.ir.verify import verify as _verify

            _verify(self.graph)
        return self.graph


# -- one-VNode networks (the per-op check, `vgraph check-onnx --ops`) ----------------------------

def example_graph(type_name: str, config: dict[str, Any], inputs: tuple[tuple[int, ...], ...] = (),
                  *, name: str = "") -> Graph:
    """A verified network of one VNode `op` of `type_name`, run on network inputs.

    `inputs` gives the float input slots' per-sample shapes (the op's
    `network_input` types the others, e.g. token ids); slots beyond the op's
    minimum arity (a variadic `stack`) are fed by identity VNodes (dropout at
    rate 0), since an unconnected slot past the minimum does not exist.  Every
    output slot is a network output, and a weight-tied config reads a
    `weight_replica` publishing its alias, so the node's own lowering is what runs.
    """
    b = NetBuilder(name or f"one-{type_name}")
    node = b.node("op", type_name, **config)
    vnode = b.graph.node(node)
    least = vnode.op.input_range()[0]
    shapes = [tuple(int(d) for d in s) for s in inputs]
    vnode.input_shapes = tuple(shapes[:least]) or None
    for slot, shape in enumerate(shapes[least:], start=least):
        feeder = b.node(f"input{slot}", "dropout", rate=0.0)
        b.graph.node(feeder).input_shapes = (shape,)
        b.edge(feeder, node, 0, slot)
    for pname, (alias, shape) in vnode.op.tied(vnode.cfg).items():
        b.node(f"publisher_{pname}", "weight_replica", peer_pnode="example", peer_node="example",
               shape=list(shape), shared_weight_alias=alias)
    for slot in range(vnode.op.outputs_for(vnode.cfg)):
        b.output(f"out{slot}", node, slot)
    return b.build()


def isolated_node(graph: Graph, node_id: str) -> Graph:
    """`graph`'s VNode `node_id` alone, as `example_graph` builds it, with the input shapes it has in
    `graph` (the per-op check on the configs a network really uses)."""
    shapes = []
    for slot in range(graph.num_inputs(node_id)):
        edge = graph.input_edge(node_id, slot)
        if edge is None:
            break  # the op's network_input types the rest
        shapes.append(graph.node(edge.src).outputs[edge.src_slot].shape)
    node = graph.node(node_id)
    return example_graph(node.type, dict(node.cfg), tuple(shapes), name=f"{graph.name}-{node_id}")
