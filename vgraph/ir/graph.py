"""The typed IR: a graph of VNodes whose use-def links the graph keeps itself.

Design (after torch.fx): nodes and edges are only changed through `Graph`
methods, which keep the invariants that hold for every graph, valid or not
yet: node ids are unique, an edge joins two existing nodes, and an input slot
receives at most one edge.  Everything that depends on the op catalog (slot
ranges, shapes, dtypes, aliases) is checked by `vgraph.ir.verify`, which a pass
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
from typing import Any, Iterable, Iterator, KeysView, Mapping, Sequence

import networkx as nx

from vgraph.base.diagnostics import Diagnostic, SourceLoc, VGraphError
from vgraph.ops import REGISTRY, OpDef
from vgraph.ops.schema import DTYPE_OF_PRECISION
from vgraph.types import TensorType

Shape = tuple[int, ...]


class GraphError(VGraphError):
    """A graph invariant would be broken (duplicate id, busy input slot, ...)."""


@dataclass(eq=False)
class VNode:
    """One VNode.  `config` holds the typed values the user wrote; `cfg` adds defaults.

    `meta` carries annotations that passes add (effective precision, assigned
    PNode, ...): they are part of the IR but not of the declared YAML.
    `outputs` caches the inferred output types (filled by `vgraph.ir.verify`).
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
    """A network: VNodes, slot-to-slot edges, and its outputs, costs and metrics.

    Long because the use-def links are private to this class: every method that adds, removes or rewires
    a VNode, an edge or an endpoint keeps them in step itself, and nothing outside vgraph/ir/ may touch
    them (tests/test_layers.py greps for it); a second class sharing the storage would break that promise.
    """

    def __init__(self, name: str = "network", *, source: str | None = None) -> None:
        self.name = name
        self.source = source  # the file it was loaded from, for messages
        self.attrs: dict[str, Any] = {}  # network-wide typed keys (precision, ...)
        self.extra: dict[str, Any] = {}  # top-level keys vgraph does not interpret, kept verbatim
        self.meta: dict[str, Any] = {}  # network-wide annotations from passes (not written to YAML)
        self._endpoints: dict[str, tuple[Endpoint, ...]] = {k: () for k in ENDPOINT_KINDS}
        # Storage: plain dicts, read by a dict lookup where a networkx view costs
        # microseconds (loading a 100k-node network makes millions of lookups).
        #   _endpoints: kind -> its endpoints, in declaration order (tuples: changed by methods only)
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
        """`add_node`, returning the node's new (input slots, users) tables (for `BulkLoader`)."""
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

    def rebuild_node(self, node_id: str, type: str, config: Mapping[str, Any] | None = None, *,
                     loc: SourceLoc | None = None, meta: Mapping[str, Any] | None = None) -> VNode:
        """Make `node_id` a new VNode of `type` in the same place of the node order, and return it.

        What a rewrite does when its replacement takes over an old node's id (a fused node where its first
        member was): the id and the position in the file's order stay, everything else is new, inferred
        shapes and types included.  The node must have no edges left, in or out: its slots may mean
        something else under the new type, so the rewrite connects it again.
        """
        old = self.node(node_id)
        if self._in[node_id] or self._out[node_id]:
            raise GraphError([Diagnostic("cannot rebuild a node that still has edges; remove them first",
                                         old.loc, node_id)])
        new = VNode(node_id, type, dict(config or {}), loc=loc, meta=dict(meta or {}))
        self._vnodes[node_id] = new  # an existing key keeps its place in the order
        if self._nx is not None:
            self._nx.nodes[node_id]["vnode"] = new
        return new

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
            raise GraphError([Diagnostic(slot_taken(busy), loc, dst)])
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
        for kind, eps in self._endpoints.items():
            moved = tuple(Endpoint(ep.name, new[0], new[1], ep.type, ep.loc) if (ep.node, ep.slot) == old else ep
                          for ep in eps)
            count += sum(a is not b for a, b in zip(eps, moved))
            self._endpoints[kind] = moved
        return count

    # -- endpoints ----------------------------------------------------------------
    @property
    def endpoints(self) -> Mapping[str, tuple[Endpoint, ...]]:
        """kind ('outputs', 'costs', 'metrics') -> its endpoints in declaration order; read-only (change
        them with `add_endpoint` and `set_endpoint`)."""
        return MappingProxyType(self._endpoints)

    @property
    def outputs(self) -> tuple[Endpoint, ...]:
        return self._endpoints["outputs"]

    @property
    def costs(self) -> tuple[Endpoint, ...]:
        return self._endpoints["costs"]

    @property
    def metrics(self) -> tuple[Endpoint, ...]:
        return self._endpoints["metrics"]

    def add_endpoint(self, kind: str, endpoint: Endpoint) -> Endpoint:
        """Declare an output, cost or metric.  Like a file's, it may be wrong (a node not there yet, a name
        used twice): `verify` reports those with the file's lines; `lint` refuses what a pass leaves so."""
        if not isinstance(endpoint, Endpoint):
            raise TypeError(f"add_endpoint takes an Endpoint, not {type(endpoint).__name__}")
        self._endpoints[_endpoint_kind(kind)] += (endpoint,)
        return endpoint

    def remove_endpoint(self, kind: str, name: str) -> Endpoint:
        """Stop declaring the endpoint `name` of `kind` (the node it read stays); returns it."""
        eps = self._endpoints[_endpoint_kind(kind)]
        for i, ep in enumerate(eps):
            if ep.name == name:
                self._endpoints[kind] = (*eps[:i], *eps[i + 1:])
                return ep
        raise KeyError(f"no {kind[:-1]} {name!r} in network {self.name!r}")

    def set_endpoint(self, kind: str, name: str, node: str, slot: int) -> Endpoint:
        """Point the endpoint `name` of `kind` at (node, slot), keeping its name, type, place and location."""
        eps = self._endpoints[_endpoint_kind(kind)]
        for i, ep in enumerate(eps):
            if ep.name == name:
                new = Endpoint(name, node, slot, ep.type, ep.loc)
                self._endpoints[kind] = (*eps[:i], new, *eps[i + 1:])
                return new
        raise KeyError(f"no {kind[:-1]} {name!r} in network {self.name!r}")

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

    def topo_ids(self) -> list[str] | None:
        """Node ids in `topo_order`; None on a cycle (where `topo_order` raises)."""
        return self._topo_ids()

    def adjacency(self) -> Iterator[tuple[VNode, Mapping[int, Edge], Mapping[str, Sequence[Edge]]]]:
        """(node, its input slot -> edge, its users: dst -> edges) for every node in insertion order: the
        whole use-def structure in one sweep, read-only, for validation over large graphs."""
        inputs, users = self._in, self._out
        for node_id, node in self._vnodes.items():
            yield node, MappingProxyType(inputs[node_id]), MappingProxyType(users[node_id])

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
        new._endpoints = dict(self._endpoints)
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
                and self._endpoints == other._endpoints
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
        if self._endpoints != other._endpoints:
            out.append("~ outputs/costs/metrics")
        if (self.name, self.attrs, self.extra) != (other.name, other.attrs, other.extra):
            out.append("~ network attributes")
        return sorted(out)

    def __repr__(self) -> str:
        return f"Graph({self.name!r}, {len(self)} vnodes, {sum(map(len, self._in.values()))} edges)"

    # -- invariants ---------------------------------------------------------------------
    def lint(self) -> None:
        """Check that the use-def storage is what `Graph`'s methods keep, and raise GraphError naming every
        broken invariant (like torch.fx's `Graph.lint`).  Cheap enough to run after every pass in debug
        mode and in the property tests; what depends on the op catalog is `verify`'s job.

        Checked: every node is stored under its id with its input and user tables; every edge joins two
        nodes, sits in its destination's slot and in its source's users, once; the two tables hold the
        same edges; endpoints are Endpoint records of known kinds with names unique per kind, reading existing
        nodes (a file may break those two, and `verify` says where; a pass that does is wrong); the networkx
        view, when built, has the same nodes and edges.
        """
        problems: list[Diagnostic] = []

        def bad(message: str, node: str | None = None) -> None:
            problems.append(Diagnostic(message, None, node))

        if set(self._in) != set(self._vnodes) or set(self._out) != set(self._vnodes):
            bad("input/user tables do not cover exactly the nodes")
        for node_id, node in self._vnodes.items():
            if not isinstance(node, VNode) or node.id != node_id:
                bad(f"stored under {node_id!r} but is {node!r}", node_id)
        from_inputs, from_users = set(), set()
        for dst, slots in self._in.items():
            for slot, e in slots.items():
                if e.dst != dst or e.dst_slot != slot:
                    bad(f"edge {e} is stored in slot {slot} of {dst!r}", dst)
                if e.src not in self._vnodes:
                    bad(f"edge {e} reads unknown node {e.src!r}", dst)
                from_inputs.add(e)
        for src, dsts in self._out.items():
            for dst, parallel in dsts.items():
                if not parallel:
                    bad(f"empty user list {src!r} -> {dst!r}", src)
                for e in parallel:
                    if e.src != src or e.dst != dst:
                        bad(f"edge {e} is stored as a use of {src!r} by {dst!r}", src)
                    if e in from_users:
                        bad(f"edge {e} is stored twice", src)
                    from_users.add(e)
        for e in sorted(from_inputs ^ from_users, key=str):
            bad(f"edge {e} is in {'the inputs' if e in from_inputs else 'the users'} table only", e.dst)
        if set(self._endpoints) != set(ENDPOINT_KINDS):
            bad(f"endpoint kinds {sorted(self._endpoints)} are not {list(ENDPOINT_KINDS)}")
        for kind, eps in self._endpoints.items():
            names = [ep.name for ep in eps if isinstance(ep, Endpoint)]
            if len(names) != len(eps) or len(set(names)) != len(names):
                bad(f"{kind}: not unique Endpoint records")
            for ep in eps:
                if isinstance(ep, Endpoint) and ep.node not in self._vnodes:
                    bad(f"{kind[:-1]} {ep.name!r} reads unknown node {ep.node!r}", ep.node)
        if self._nx is not None:
            if set(self._nx.nodes) != set(self._vnodes) or any(
                    self._nx.nodes[n].get("vnode") is not v for n, v in self._vnodes.items()):
                bad("the networkx view's nodes are out of step")
            if {d["edge"] for *_, d in self._nx.edges(data=True)} != from_users:
                bad("the networkx view's edges are out of step")
        if problems:
            raise GraphError(problems)

    def loader(self) -> "BulkLoader":
        """Fast insertion for readers that build a whole graph at once (see `BulkLoader`)."""
        return BulkLoader(self)


def slot_taken(busy: Edge) -> str:
    """Why an edge cannot go into a slot that `busy` already feeds (one message for every way in)."""
    at = f" (first at line {busy.loc.line})" if busy.loc else ""
    return f"input slot {busy.dst_slot} already receives {busy}{at}; an input takes at most one edge"


def _endpoint_kind(kind: str) -> str:
    if kind not in ENDPOINT_KINDS:
        raise GraphError([Diagnostic(f"unknown endpoint kind {kind!r}; one of {', '.join(ENDPOINT_KINDS)}")])
    return kind


class BulkLoader:
    """`add_node` and `add_edge` for a reader that builds a whole graph (yamlio, at 100k VNodes): the same
    invariants, checked with the per-node tables the loader hands back instead of a lookup per edge end.

    `add_node` returns an opaque handle for the node; `add_edge` takes the handles of both ends and returns
    the edge already feeding that input slot (nothing added) or None (added).  Unknown ends are the
    reader's to report, with its own line numbers, before it asks for the edge.
    """

    def __init__(self, graph: Graph) -> None:
        self.graph = graph

    def add_node(self, node: VNode) -> tuple[VNode, dict[int, Edge], dict[str, list[Edge]]]:
        inputs, users = self.graph._add(node)
        return node, inputs, users

    def add_edge(self, edge: Edge, src: tuple[VNode, dict, dict], dst: tuple[VNode, dict, dict]) -> Edge | None:
        inputs = dst[1]
        busy = inputs.get(edge.dst_slot)
        if busy is not None:
            return busy
        self.graph._link(edge, inputs, src[2])
        return None

    def add_endpoint(self, kind: str, endpoint: Endpoint) -> None:
        self.graph.add_endpoint(kind, endpoint)


def iter_params(graph: Graph) -> Iterable[tuple[VNode, str, Shape]]:
    """Every parameter owned by a node (tied parameters are counted at the publisher)."""
    for n in graph.nodes:
        for pname, shape in n.op.param_shapes(n.cfg).items():
            yield n, pname, shape
