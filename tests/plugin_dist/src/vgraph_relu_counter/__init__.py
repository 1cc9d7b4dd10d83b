"""A minimal third-party plugin: a pass that swaps relu for gelu, and a `square` op type."""
from collections import Counter

from vgraph.ops import OpDef, register_op
from vgraph.pass_api import Pass


class ReluToGelu(Pass):
    """Replace every relu activation with gelu."""

    name = "relu-to-gelu"

    def run(self, graph, ctx):
        changed = 0
        for node in graph.nodes:
            if node.type == "relu":
                node.type = "gelu"
                node.__dict__.pop("cfg", None)
                changed += 1
        return Counter(replaced=changed)


def register_ops():
    register_op(OpDef("square", "activation", "x * x", origin="vgraph-relu-counter"), replace=True)
