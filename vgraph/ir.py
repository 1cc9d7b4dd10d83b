"""The typed IR: a graph of VNodes whose use-def links the graph keeps itself.

Design (after torch.fx): nodes and edges are only changed through `Graph`
methods, which keep the invariants that hold for every graph, valid or not
yet: node ids are unique, an edge joins two existing nodes, and an input slot
receives at most one edge.  Everything that depends on the op catalog (slot
ranges, shapes, dtypes, aliases) is checked by `vgraph.verify`, which a pass
manager runs after every pass.  The storage is a few plain dicts (one lookup
per question, which matters at 100k VNodes); `Graph.nx` gives the same graph
as a networkx MultiDiGraph, kept in step, so graph algorithms (cycles,
reachability, partitioning) come for free.
"""
from __future__ import annotations

import copy as _copy
from heapq import heappop, heappush
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any, Iterable, Iterator, KeysView, Mapping

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
        # Storage: plain dicts, read by a dict lookup where a networkx view costs
        # microseconds (loading a 100k-node network makes millions of lookups).
        #   _vnodes: id -> VNode, in insertion order
        #   _in:     dst -> {input slot: edge}
        #   _out:    src -> {dst -> [edges]}, networkx's adjacency layout, so edges
        #            come out in the order networkx gives (a dst stays where its first
        #            edge put it until its last edge goes)
        # The networkx graph (`nx`) is built on first use and kept in step from then on.
        self._vnodes: dict[str, VNode] = {}
        self._in: dict[str, dict[int, Edge]] = {}
        self._out: dict[str, dict[str, list[Edge]]] = {}
        self._nx: nx.MultiDiGraph | None = None

    # -- nodes ------------------------------------------------------------------
    def add_node(self, node: VNode) -> VNode:
        self._add(node)
        return node

    def _add(self, node: VNode) -> tuple[dict[int, Edge], dict[str, list[Edge]]]:
        """`add_node`, returning the node's new (input slots, users) tables."""
        vnodes = self._vnodes
        count = len(vnodes)
        vnodes.setdefault(node.id, node)  # one lookup to test and insert
        if len(vnodes) == count:
            raise GraphError([Diagnostic("duplicate node id", node.loc, node.id)])
        inputs: dict[int, Edge] = {}
        users: dict[str, list[Edge]] = {}
        self._in[node.id] = inputs
        self._out[node.id] = users
        if self._nx is not None:
            self._nx.add_node(node.id, vnode=node)
        return inputs, users

    def remove_node(self, node_id: str) -> VNode:
        """Remove a node that nothing uses any more (its own input edges go with it)."""
        node = self.node(node_id)
        users = [e for e in self.out_edges(node_id)]
        refs = [ep for ep in self.iter_endpoints() if ep.node == node_id]
        if users or refs:
            what = ", ".join([str(e) for e in users] + [f"{ep.name}" for ep in refs])
            raise GraphError([Diagnostic(f"cannot remove: still used by {what}", node.loc, node_id)])
        for e in list(self._in[node_id].values()):
            self.remove_edge(e)
        del self._vnodes[node_id], self._in[node_id], self._out[node_id]
        if self._nx is not None:
            self._nx.remove_node(node_id)
        return node

    def node(self, node_id: str) -> VNode:
        try:
            return self._vnodes[node_id]
        except KeyError:
            raise KeyError(f"no node {node_id!r} in network {self.name!r}") from None

    def __contains__(self, node_id: object) -> bool:
        try:
            return node_id in self._vnodes
        except TypeError:  # unhashable: certainly not a node id
            return False

    def __len__(self) -> int:
        return len(self._vnodes)

    @property
    def nodes(self) -> list[VNode]:
        """Nodes in insertion order (the file's order for a loaded graph)."""
        return list(self._vnodes.values())

    def node_ids(self) -> KeysView[str]:
        """Node ids in insertion order (a live, read-only view)."""
        return self._vnodes.keys()

    def input_index(self) -> Mapping[str, Mapping[int, Edge]]:
        """Read-only index node -> {input slot: edge}, for whole-graph sweeps that must be fast."""
        return MappingProxyType(self._in)

    def nodes_of_type(self, type_name: str) -> list[VNode]:
        canon = REGISTRY.canonical(type_name) or type_name
        return [n for n in self.nodes if n.type == canon]

    # -- edges ------------------------------------------------------------------
    def add_edge(self, src: str, src_slot: int, dst: str, dst_slot: int,
                 loc: SourceLoc | None = None) -> Edge:
        edge = Edge(src, src_slot, dst, dst_slot, loc)
        for end in (src, dst):
            if end not in self._vnodes:
                raise GraphError([Diagnostic(f"edge {edge} refers to unknown node {end!r}", loc,
                                             dst if end == src else src)])
        busy = self._in[dst].get(dst_slot)
        if busy is not None:
            at = f" (first at line {busy.loc.line})" if busy.loc else ""
            raise GraphError([Diagnostic(f"input slot {dst_slot} already receives {busy}{at}; "
                                         f"an input takes at most one edge", loc, dst)])
        self._link(edge)
        return edge

    def _link(self, edge: Edge, dst_inputs: dict[int, Edge] | None = None,
              src_users: dict[str, list[Edge]] | None = None) -> None:
        """Store an edge whose ends exist and whose input slot is free (callers checked;
        one that holds `self._in[edge.dst]` or `self._out[edge.src]` passes them)."""
        src, dst = edge.src, edge.dst
        users = self._out[src] if src_users is None else src_users
        parallel = users.get(dst)
        if parallel is None:
            users[dst] = [edge]
        else:
            parallel.append(edge)
        (self._in[dst] if dst_inputs is None else dst_inputs)[edge.dst_slot] = edge
        if self._nx is not None:
            self._nx.add_edge(src, dst, key=(edge.src_slot, edge.dst_slot), edge=edge)

    def remove_edge(self, edge: Edge) -> None:
        key = (edge.src_slot, edge.dst_slot)
        parallel = self._out.get(edge.src, {}).get(edge.dst, ())
        at = next((i for i, e in enumerate(parallel) if (e.src_slot, e.dst_slot) == key), None)
        if at is None:
            raise nx.NetworkXError(f"The edge {edge.src}-{edge.dst}-{key} not in graph.")
        del parallel[at]  # type: ignore[attr-defined]
        if not parallel:
            del self._out[edge.src][edge.dst]
        del self._in[edge.dst][edge.dst_slot]
        if self._nx is not None:
            self._nx.remove_edge(edge.src, edge.dst, key=key)

    @property
    def edges(self) -> list[Edge]:
        """Every edge, in networkx's order: by source node, then first connection, then slots."""
        return [e for dsts in self._out.values() for parallel in dsts.values() for e in parallel]

    def in_edges(self, node_id: str) -> list[Edge]:
        """Incoming edges ordered by input slot."""
        slots = self._in[node_id]
        return [slots[s] for s in sorted(slots)]

    def out_edges(self, node_id: str) -> list[Edge]:
        return sorted((e for parallel in self._out[node_id].values() for e in parallel),
                      key=lambda e: (e.src_slot, e.dst, e.dst_slot))

    def input_edge(self, node_id: str, slot: int) -> Edge | None:
        return self._in[node_id].get(slot)

    def producer(self, node_id: str, slot: int) -> VNode | None:
        edge = self.input_edge(node_id, slot)
        return None if edge is None else self.node(edge.src)

    def users(self, node_id: str, slot: int | None = None) -> list[Edge]:
        return [e for e in self.out_edges(node_id) if slot is None or e.src_slot == slot]

    def num_inputs(self, node_id: str) -> int:
        """Connected or declared inputs: the op's minimum, or one past the highest edge."""
        lo, _ = self.node(node_id).op.input_range()
        slots = self._in[node_id]
        return max(lo, max(slots) + 1) if slots else lo

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

        Backends name these feeds "<node>:in<slot>" (e.g. "embedder:in0" for token
        ids, "loss:in1" for targets).
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
        order = self._topo_ids()
        if order is None:
            raise GraphError([self.cycle_diagnostic()])
        vnodes = self._vnodes
        return [vnodes[n] for n in order]

    def _topo_ids(self) -> list[str] | None:
        """Node ids in `topo_order`; None on a cycle."""
        order = list(self._topo_iter())
        return order if len(order) == len(self._vnodes) else None

    def _topo_iter(self) -> Iterator[str]:
        """Node ids in topological order, always taking the earliest-inserted ready node
        (what networkx's lexicographical_topological_sort gives with that key).

        Stops early on a cycle: a caller that needs every node compares the count.
        Do not change the graph while iterating.
        """
        ids = list(self._vnodes)
        index = {n: i for i, n in enumerate(ids)}
        inputs, out = self._in, self._out
        indegree = [len(inputs[n]) for n in ids]
        ready = [i for i, d in enumerate(indegree) if d == 0]  # ascending: already a heap
        while ready:
            node_id = ids[heappop(ready)]
            yield node_id
            for dst, parallel in out[node_id].items():
                j = index[dst]
                indegree[j] -= len(parallel)
                if indegree[j] == 0:
                    heappush(ready, j)

    def cycle_diagnostic(self) -> Diagnostic:
        cycle = nx.find_cycle(self.nx)
        names = [u for u, *_ in cycle] + [cycle[0][0]]
        first = self.node(names[0])
        return Diagnostic(f"cycle: {' -> '.join(names)}", first.loc, first.id)

    def is_acyclic(self) -> bool:
        return self._topo_ids() is not None

    @property
    def nx(self) -> nx.MultiDiGraph:
        """The graph as a networkx MultiDiGraph, for read-only algorithms.

        Nodes carry their VNode as attribute `vnode`, edges their Edge as `edge`,
        keyed (src_slot, dst_slot).  Built on first use, then kept in step with
        every change made through this class.
        """
        if self._nx is None:
            g = nx.MultiDiGraph()
            g.add_nodes_from((node_id, {"vnode": v}) for node_id, v in self._vnodes.items())
            g.add_edges_from((e.src, e.dst, (e.src_slot, e.dst_slot), {"edge": e}) for e in self.edges)
            self._nx = g
        return self._nx

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
            new._link(e)
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
        return f"Graph({self.name!r}, {len(self)} vnodes, {sum(map(len, self._in.values()))} edges)"


def iter_params(graph: Graph) -> Iterable[tuple[VNode, str, Shape]]:
    """Every parameter owned by a node (tied parameters are counted at the publisher)."""
    for n in graph.nodes:
        for pname, shape in n.op.param_shapes(n.cfg).items():
            yield n, pname, shape
