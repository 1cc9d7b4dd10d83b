"""Static numbers of a verified graph: parameters, FLOPs and activation bytes.

FLOPs are the forward cost per sample (multiply-add = 2); activation bytes
are the per-sample output sizes at the declared dtypes.  Tied weights count
once, at the node that publishes them.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from math import prod

from vgraph.ir.graph import Graph, VNode

UNGROUPED = "(ungrouped)"


@dataclass
class NodeStats:
    id: str
    type: str
    group: str
    outputs: list[str]
    params: int
    flops: int
    activation_bytes: int


@dataclass
class GroupStats:
    vnodes: int = 0
    params: int = 0
    flops_per_sample: int = 0
    activation_bytes: int = 0


@dataclass
class Analysis:
    name: str
    nodes: list[NodeStats]
    groups: dict[str, GroupStats] = field(default_factory=dict)

    @property
    def params(self) -> int:
        return sum(n.params for n in self.nodes)

    @property
    def flops_per_sample(self) -> int:
        return sum(n.flops for n in self.nodes)

    @property
    def activation_bytes(self) -> int:
        return sum(n.activation_bytes for n in self.nodes)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "vnodes": len(self.nodes),
            "params": self.params,
            "flops_per_sample": self.flops_per_sample,
            "activation_bytes_per_sample": self.activation_bytes,
            "by_type": dict(sorted(Counter(n.type for n in self.nodes).items())),
            "groups": {g: {"vnodes": s.vnodes, "params": s.params, "flops_per_sample": s.flops_per_sample,
                           "activation_bytes_per_sample": s.activation_bytes}
                       for g, s in self.groups.items()},
            "nodes": [{"id": n.id, "type": n.type, "group": n.group, "outputs": n.outputs,
                       "params": n.params, "flops_per_sample": n.flops,
                       "activation_bytes_per_sample": n.activation_bytes} for n in self.nodes],
        }


def node_params(node: VNode) -> int:
    return sum(prod(s) for s in node.op.param_shapes(node.cfg).values())


def _inputs(graph: Graph, node: VNode):
    from vgraph.types import TensorType

    out = []
    for slot in range(graph.num_inputs(node.id)):
        e = graph.input_edge(node.id, slot)
        if e is not None:
            out.append(graph.node(e.src).outputs[e.src_slot])
        elif node.input_shapes and slot < len(node.input_shapes):
            out.append(TensorType(tuple(node.input_shapes[slot])))
        elif node.op.network_input:
            out.append(node.op.network_input(node.cfg, slot, out))
    return out


def analyze(graph: Graph) -> Analysis:
    """Per-node and per-colocation-group numbers; the graph must be verified."""
    stats = []
    groups: dict[str, GroupStats] = {}
    for n in graph.topo_order():
        s = NodeStats(n.id, n.type, n.group or UNGROUPED, [str(t) for t in n.outputs], node_params(n),
                      n.op.flop_count(n.cfg, _inputs(graph, n), n.outputs),
                      sum(t.nbytes for t in n.outputs))
        stats.append(s)
        g = groups.setdefault(s.group, GroupStats())
        g.vnodes += 1
        g.params += s.params
        g.flops_per_sample += s.flops
        g.activation_bytes += s.activation_bytes
    return Analysis(graph.name, stats, groups)


def human(n: float, unit: str = "") -> str:
    for factor, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= factor:
            return f"{n / factor:.2f}{suffix}{unit}"
    return f"{n:g}{unit}"


def human_bytes(n: int) -> str:
    """1.5e7 -> "15.00 MB" (decimal units, like the FLOP counts)."""
    text = human(n)
    return f"{text[:-1]} {text[-1]}B" if text[-1:].isalpha() else f"{text} B"


def compact_types(types: list[str]) -> str:
    """Output types with runs of equal ones counted: a broadcast to 8 heads shows
    "8 x float16[128, 512]" instead of the same type eight times."""
    parts: list[str] = []
    i = 0
    while i < len(types):
        j = i
        while j < len(types) and types[j] == types[i]:
            j += 1
        parts.append(types[i] if j - i == 1 else f"{j - i} x {types[i]}")
        i = j
    return ", ".join(parts) if parts else "-"


def format_table(a: Analysis) -> str:
    rows = [("node", "type", "outputs", "params", "FLOPs/sample")]
    rows += [(n.id, n.type, compact_types(n.outputs), f"{n.params:,}", human(n.flops)) for n in a.nodes]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [f"network {a.name!r}: {len(a.nodes)} VNodes, {a.params:,} parameters, "
             f"{human(a.flops_per_sample)} FLOPs per sample (forward)"]
    for i, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if j < 3 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    grows = [("colocation group", "vnodes", "params", "FLOPs/sample", "act bytes/sample")]
    grows += [(g, str(s.vnodes), f"{s.params:,}", human(s.flops_per_sample), human_bytes(s.activation_bytes))
              for g, s in a.groups.items()]
    grows.append(("total", str(len(a.nodes)), f"{a.params:,}", human(a.flops_per_sample),
                  human_bytes(a.activation_bytes)))
    gw = [max(len(r[i]) for r in grows) for i in range(5)]
    for i, r in enumerate(grows):
        if i == len(grows) - 1:
            lines.append("  ".join("-" * w for w in gw))
        lines.append("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, gw))))
        if i == 0:
            lines.append("  ".join("-" * w for w in gw))
    return "\n".join(lines)
