"""The IR: `Graph` and `VNode` with their use-def links (`graph`), validation and type inference
(`verify`), and networks written in Python (`builder`).  A graph changes only through `Graph`'s methods."""
from vgraph.ir.graph import ENDPOINT_KINDS, Edge, Endpoint, Graph, GraphError, VNode

__all__ = ["ENDPOINT_KINDS", "Edge", "Endpoint", "Graph", "GraphError", "VNode"]
