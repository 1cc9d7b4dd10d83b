"""vgraph: a typed graph IR, optimisation passes and backends for network YAML.

The core (this package) knows the IR, the op registry, YAML I/O, validation,
analysis, the pass manager and plugin discovery.  Built-in passes live in
`vgraph.passes` and backends in `vgraph.backends`; both depend on the core,
never the reverse.
"""
from vgraph.base.diagnostics import Diagnostic, SourceLoc, VGraphError
from vgraph.ir.graph import Edge, Endpoint, Graph, GraphError, VNode
from vgraph.ir.verify import verify
from vgraph.ops import REGISTRY, OpDef, get_op, register_op
from vgraph.types import ShapeError, TensorType
from vgraph.yamlio import dumps, load, loads, save

__version__ = "0.2.0"  # the one source of the version (pyproject.toml reads it)
__all__ = ["Diagnostic", "SourceLoc", "VGraphError", "Edge", "Endpoint", "Graph", "GraphError", "VNode",
           "REGISTRY", "OpDef", "get_op", "register_op", "ShapeError", "TensorType", "verify",
           "dumps", "load", "loads", "save"]
