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
