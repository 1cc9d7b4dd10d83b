"""The typed IR: a graph of VNodes whose use-def links the graph keeps itself.

Design (after torch.fx): nodes and edges are only changed through `Graph`
methods, which keep the invariants that hold for every graph, valid or not
yet: node ids are unique, an edge joins two existing nodes, and an input slot
receives at most one edge.  Everything that depends on the op catalog (slot
ranges, shapes, dtypes, aliases) is checked by `vgraph.verify`, which a pass
manager runs after every pass.  The storage is a networkx MultiDiGraph so
graph algorithms (cycles, reachability, partitioning) come for free.
"""
from __future__ import annotations

import copy as _copy
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable, Iterator

import networkx as nx

from .diagnostics import Diagnostic, SourceLoc, VGraphError
from .ops import REGISTRY, OpDef
from .ops.schema import DTYPE_OF_PRECISION
from .types import TensorType

Shape = tuple[int, ...]


class GraphError(VGraphError):
    """A graph invariant would be broken (duplicate id, busy input slot, ...)."""


@dataclass(eq=False)
class VNode:
    """One VNode.  `config` holds the typed values the user wrote; `cfg` adds defaults.

    `meta` carries annotations that passes add (effective precision, assigned
    PNode, ...): they are part of the IR but not of the declared YAML.
    `outputs` caches the inferred output types (filled by `vgraph.verify`).
    """

    id: str
    type: str
    config: dict[str, Any] = field(default_factory=dict)
    input_shapes: tuple[Shape, ...] | None = None
    output_shapes: tuple[Shape, ...] | None = None
    loc: SourceLoc | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    outputs: tuple[TensorType, ...] = ()

    @property
    def op(self) -> OpDef:
        return REGISTRY.get(self.type)

    @cached_property
    def cfg(self) -> dict[str, Any]:
        """Config with the schema's defaults filled in (cached; see `set_config`)."""
        return self.op.schema.resolve(self.config)

    def set_config(self, **values: Any) -> None:
        """Change typed config values (None removes a key) and drop the cache."""
        for key, value in values.items():
            if value is None:
                self.config.pop(key, None)
            else:
                self.config[key] = value
        self.__dict__.pop("cfg", None)

    @property
    def num_outputs(self) -> int:
        return self.op.outputs_for(self.cfg)

    @property
    def group(self) -> str | None:
        return self.config.get("colocate_group")

    def _key(self) -> tuple:
        return (self.id, self.type, self.config, self.input_shapes, self.output_shapes, self.meta)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VNode) and self._key() == other._key()

    def __repr__(self) -> str:
        return f"VNode({self.id!r}, {self.type!r})"


@dataclass(frozen=True)
class Edge:
    """(src, src_slot) -> (dst, dst_slot)."""

    src: str
    src_slot: int
    dst: str
    dst_slot: int
    loc: SourceLoc | None = field(default=None, compare=False)

    def __str__(self) -> str:
        return f"{self.src}:{self.src_slot} -> {self.dst}:{self.dst_slot}"


ENDPOINT_KINDS = ("outputs", "costs", "metrics")


@dataclass(frozen=True)
class Endpoint:
    """A named tensor a client reads (output), training minimises (cost) or logs (metric)."""

    name: str
    node: str
    slot: int = 0
    type: str | None = None  # metrics only, e.g. "learning_rate"
    loc: SourceLoc | None = field(default=None, compare=False)


class Graph:
    """A network: VNodes, slot-to-slot edges, and its outputs, costs and metrics."""

    def __init__(self, name: str = "network", *, source: str | None = None) -> None:
        self.name = name
        self.source = source  # the file it was loaded from, for messages
        self.attrs: dict[str, Any] = {}  # network-wide typed keys (precision, ...)
        self.extra: dict[str, Any] = {}  # top-level keys vgraph does not interpret, kept verbatim
        self.meta: dict[str, Any] = {}  # network-wide annotations from passes (not written to YAML)
        self.endpoints: dict[str, list[Endpoint]] = {k: [] for k in ENDPOINT_KINDS}
        self._g = nx.MultiDiGraph()

    # -- nodes ------------------------------------------------------------------
    def add_node(self, node: VNode) -> VNode:
        if node.id in self._g:
            raise GraphError([Diagnostic("duplicate node id", node.loc, node.id)])
        self._g.add_node(node.id, vnode=node)
        return node

    def remove_node(self, node_id: str) -> VNode:
        """Remove a node that nothing uses any more (its own input edges go with it)."""
        node = self.node(node_id)
        users = [e for e in self.out_edges(node_id)]
        refs = [ep for ep in self.iter_endpoints() if ep.node == node_id]
        if users or refs:
            what = ", ".join([str(e) for e in users] + [f"{ep.name}" for ep in refs])
            raise GraphError([Diagnostic(f"cannot remove: still used by {what}", node.loc, node_id)])
        self._g.remove_node(node_id)
        return node

    def node(self, node_id: str) -> VNode:
        try:
            return self._g.nodes[node_id]["vnode"]
        except KeyError:
            raise KeyError(f"no node {node_id!r} in network {self.name!r}") from None

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._g

    def __len__(self) -> int:
        return self._g.number_of_nodes()

    @property
    def nodes(self) -> list[VNode]:
        """Nodes in insertion order (the file's order for a loaded graph)."""
        return [d["vnode"] for _, d in self._g.nodes(data=True)]

    def nodes_of_type(self, type_name: str) -> list[VNode]:
        canon = REGISTRY.canonical(type_name) or type_name
        return [n for n in self.nodes if n.type == canon]

    # -- edges ------------------------------------------------------------------
    def add_edge(self, src: str, src_slot: int, dst: str, dst_slot: int,
                 loc: SourceLoc | None = None) -> Edge:
        edge = Edge(src, src_slot, dst, dst_slot, loc)
        for end in (src, dst):
            if end not in self._g:
                raise GraphError([Diagnostic(f"edge {edge} refers to unknown node {end!r}", loc,
                                             dst if end == src else src)])
        busy = self.input_edge(dst, dst_slot)
        if busy is not None:
            at = f" (first at line {busy.loc.line})" if busy.loc else ""
            raise GraphError([Diagnostic(f"input slot {dst_slot} already receives {busy}{at}; "
                                         f"an input takes at most one edge", loc, dst)])
        self._g.add_edge(src, dst, key=(src_slot, dst_slot), edge=edge)
        return edge

    def remove_edge(self, edge: Edge) -> None:
        self._g.remove_edge(edge.src, edge.dst, key=(edge.src_slot, edge.dst_slot))

    @property
    def edges(self) -> list[Edge]:
        return [d["edge"] for _, _, d in self._g.edges(data=True)]

    # The adjacency lookups below read networkx's public `pred`/`succ` mappings
    # directly: edge views cost microseconds each, and validation of a 100k-node
    # network makes hundreds of thousands of these lookups.
    def in_edges(self, node_id: str) -> list[Edge]:
        """Incoming edges ordered by input slot."""
        return sorted((d["edge"] for keyed in self._g.pred[node_id].values() for d in keyed.values()),
                      key=lambda e: e.dst_slot)

    def out_edges(self, node_id: str) -> list[Edge]:
        return sorted((d["edge"] for keyed in self._g.succ[node_id].values() for d in keyed.values()),
                      key=lambda e: (e.src_slot, e.dst, e.dst_slot))

    def input_edge(self, node_id: str, slot: int) -> Edge | None:
        for keyed in self._g.pred[node_id].values():
            for key, data in keyed.items():
                if key[1] == slot:
                    return data["edge"]
        return None

    def producer(self, node_id: str, slot: int) -> VNode | None:
        edge = self.input_edge(node_id, slot)
        return None if edge is None else self.node(edge.src)

    def users(self, node_id: str, slot: int | None = None) -> list[Edge]:
        return [e for e in self.out_edges(node_id) if slot is None or e.src_slot == slot]

    def num_inputs(self, node_id: str) -> int:
        """Connected or declared inputs: the op's minimum, or one past the highest edge."""
        lo, _ = self.node(node_id).op.input_range()
        top = max((e.dst_slot + 1 for e in self.in_edges(node_id)), default=0)
        return max(lo, top)

    def replace_uses(self, old: tuple[str, int], new: tuple[str, int]) -> int:
        """Point every edge and endpoint reading `old` (node, slot) at `new`; returns the count."""
        count = 0
        for e in self.users(old[0], old[1]):
            self.remove_edge(e)
            self.add_edge(new[0], new[1], e.dst, e.dst_slot, e.loc)
            count += 1
        for kind, eps in self.endpoints.items():
            for i, ep in enumerate(eps):
                if (ep.node, ep.slot) == old:
                    eps[i] = Endpoint(ep.name, new[0], new[1], ep.type, ep.loc)
                    count += 1
        return count

    # -- endpoints ----------------------------------------------------------------
    @property
    def outputs(self) -> list[Endpoint]:
        return self.endpoints["outputs"]

    @property
    def costs(self) -> list[Endpoint]:
        return self.endpoints["costs"]

    @property
    def metrics(self) -> list[Endpoint]:
        return self.endpoints["metrics"]

    def network_inputs(self) -> list[tuple[str, int]]:
        """(node, slot) of every input slot no edge feeds: data the caller supplies.

        Backends name these feeds "<node>:<slot>" (e.g. "embedder:0" for token
        ids, "loss:1" for targets), as they name boundary tensors of a partition.
        """
        out = []
        for n in self.topo_order():
            for slot in range(self.num_inputs(n.id)):
                if self.input_edge(n.id, slot) is None:
                    out.append((n.id, slot))
        return out

    def iter_endpoints(self) -> Iterator[Endpoint]:
        for kind in ENDPOINT_KINDS:
            yield from self.endpoints[kind]

    # -- order and analysis --------------------------------------------------------
    def topo_order(self) -> list[VNode]:
        """Deterministic topological order: ties broken by insertion order."""
        index = {n: i for i, n in enumerate(self._g)}
        try:
            order = nx.lexicographical_topological_sort(self._g, key=index.__getitem__)
            return [self._g.nodes[n]["vnode"] for n in order]
        except nx.NetworkXUnfeasible:
            raise GraphError([self.cycle_diagnostic()]) from None

    def cycle_diagnostic(self) -> Diagnostic:
        cycle = nx.find_cycle(self._g)
        names = [u for u, *_ in cycle] + [cycle[0][0]]
        first = self.node(names[0])
        return Diagnostic(f"cycle: {' -> '.join(names)}", first.loc, first.id)

    def is_acyclic(self) -> bool:
        return nx.is_directed_acyclic_graph(self._g)

    @property
    def nx(self) -> nx.MultiDiGraph:
        """The underlying networkx graph, for read-only algorithms."""
        return self._g

    def activation_dtype(self, node: VNode) -> str:
        """Declared activation dtype: the node's own keys win over the network's."""
        cfg = node.config
        prec = (cfg.get("activation_precision") or cfg.get("precision")
                or self.attrs.get("activation_precision") or self.attrs.get("precision") or "float32")
        return DTYPE_OF_PRECISION[prec]

    def param_dtype(self, node: VNode) -> str:
        cfg = node.config
        prec = (cfg.get("param_precision") or cfg.get("precision")
                or self.attrs.get("param_precision") or self.attrs.get("precision") or "float32")
        return DTYPE_OF_PRECISION[prec]

    def publishers(self) -> dict[str, VNode]:
        """shared_weight_alias -> the node that publishes it (first one wins)."""
        pubs: dict[str, VNode] = {}
        for n in self.nodes:
            alias = n.config.get("shared_weight_alias")
            if alias and alias not in pubs:
                pubs[alias] = n
        return pubs

    # -- copies and comparison --------------------------------------------------------
    def copy(self) -> "Graph":
        new = Graph(self.name, source=self.source)
        new.attrs = dict(self.attrs)
        new.extra = _copy.deepcopy(self.extra)
        new.meta = _copy.deepcopy(self.meta)
        new.endpoints = {k: list(v) for k, v in self.endpoints.items()}
        for n in self.nodes:
            new.add_node(VNode(n.id, n.type, dict(n.config), n.input_shapes, n.output_shapes,
                               n.loc, _copy.deepcopy(n.meta), n.outputs))
        for e in self.edges:
            new._g.add_edge(e.src, e.dst, key=(e.src_slot, e.dst_slot), edge=e)
        return new

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Graph):
            return NotImplemented
        return (self.name == other.name and self.attrs == other.attrs and self.extra == other.extra
                and self.meta == other.meta
                and self.endpoints == other.endpoints
                and {n.id: n for n in self.nodes} == {n.id: n for n in other.nodes}
                and set(self.edges) == set(other.edges))

    def diff(self, other: "Graph") -> list[str]:
        """Human-readable differences, for tests and for a pass manager's change report."""
        out = []
        a, b = {n.id: n for n in self.nodes}, {n.id: n for n in other.nodes}
        out += [f"- node {i}" for i in a.keys() - b.keys()]
        out += [f"+ node {i}" for i in b.keys() - a.keys()]
        out += [f"~ node {i}" for i in a.keys() & b.keys() if a[i] != b[i]]
        ea, eb = set(self.edges), set(other.edges)
        out += [f"- edge {e}" for e in ea - eb] + [f"+ edge {e}" for e in eb - ea]
        if self.endpoints != other.endpoints:
            out.append("~ outputs/costs/metrics")
        if (self.name, self.attrs, self.extra) != (other.name, other.attrs, other.extra):
            out.append("~ network attributes")
        return sorted(out)

    def __repr__(self) -> str:
        return f"Graph({self.name!r}, {len(self)} vnodes, {self._g.number_of_edges()} edges)"


def iter_params(graph: Graph) -> Iterable[tuple[VNode, str, Shape]]:
    """Every parameter owned by a node (tied parameters are counted at the publisher)."""
    for n in graph.nodes:
        for pname, shape in n.op.param_shapes(n.cfg).items():
            yield n, pname, shape
