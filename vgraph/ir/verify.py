"""Semantic validation and type inference over a Graph.

`check` reports every problem it sees (arity, slots, unconnected inputs,
shape and dtype disagreement along edges, declared shapes that contradict
inference, weight aliases, cycles, outputs/costs/metrics) and infers every
output type on the way.  A node whose own definition is broken is skipped,
and so is whatever depends on it, so one mistake does not produce a cascade
of messages.

It walks the graph once, in file order, checking each node (type, slot ranges
of its edges, published weight) and inferring its types as soon as everything
feeding it has been seen.  Files are nearly always written in topological
order, so that one walk usually does everything; otherwise the rest is
inferred in topological order afterwards.  The walk keeps lookups in tables
with one entry per node to a minimum: past a few ten thousand nodes such a
table no longer fits in the processor's cache, and each lookup costs a trip
to memory.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from vgraph.base.diagnostics import Diagnostic, DiagnosticSink, VGraphError, sorted_diagnostics
from vgraph.ir.graph import Edge, Endpoint, Graph, VNode
from vgraph.ops import REGISTRY, InferCtx, OpDef
from vgraph.types import ShapeError, TensorType

_KIND_DTYPE = {"int": "int64", "str": "string"}
METRIC_TYPES = (None, "learning_rate", "loss", "grad_norm")
_UNSEEN: Any = object()
MAX_ID_CHARS = 256


def id_problem(node_id: object) -> str | None:
    """Why `node_id` is not a valid VNode id, or None.

    An id is 1 to 256 printable characters (Unicode letters, marks, digits,
    punctuation, symbols and the ASCII space), neither starting nor ending with
    a space: ids are echoed in messages, logs and drawings, where a control
    character, a newline or an invisible one would forge or hide text.
    """
    if not isinstance(node_id, str) or not node_id:
        return "a node id must not be empty"
    if len(node_id) > MAX_ID_CHARS:
        return f"a node id is at most {MAX_ID_CHARS} characters, this one has {len(node_id)}"
    if not node_id.isprintable():
        bad = next(c for c in node_id if not c.isprintable())
        return (f"a node id may hold only printable characters, not {ascii(bad)} (no control, format or "
                f"line-break characters, no spaces other than ' ')")
    if node_id[0] == " " or node_id[-1] == " ":
        return "a node id must not start or end with a space"
    return None

Outputs = tuple[TensorType, ...]


def verify(graph: Graph) -> Graph:
    """Raise VGraphError with every problem; on success the types are inferred."""
    sink = DiagnosticSink()
    check(graph, sink)
    sink.raise_if_errors()
    return graph


def problems(graph: Graph) -> list[Diagnostic]:
    sink = DiagnosticSink()
    check(graph, sink)
    return sorted_diagnostics(d for d in sink.items if d.severity == "error")


def check(graph: Graph, sink: DiagnosticSink, skip: Iterable[str] = ()) -> None:
    """Report into `sink`; nodes in `skip` are known broken (already reported)."""
    _Checker(graph, sink, set(skip)).run()


class _Checker:
    """One verification of a graph: configs, edge slots, tied weights and publishers, type inference in
    topological order, endpoints.

    Long because its checks share the sets of what is already broken or unknown, so that one problem is
    reported once and never again as the inference failures it causes downstream.
    """

    def __init__(self, graph: Graph, sink: DiagnosticSink, skip: set[str]) -> None:
        self.graph = graph
        self.sink = sink
        self.skip = skip  # broken before we started (already reported)
        self.broken = set(skip)  # ... plus unknown types and bad edge slots
        self.unknown = set(skip)  # ... plus what could not be inferred or is fed by it
        self.done: dict[str, Outputs | None] = {}  # inferred outputs; None: could not be
        self.inference: list[Diagnostic] = []  # kept apart: a cycle voids them
        self.publishers: dict[str, VNode] = {}
        self._ops: dict[str, OpDef | None] = {}
        self._defaults: dict[str, dict[str, Any]] = {}

    def op(self, node: VNode) -> OpDef | None:
        """The node's OpDef (None when its type is unknown), looked up once per type."""
        try:
            return self._ops[node.type]
        except KeyError:
            op = REGISTRY.get(node.type) if REGISTRY.canonical(node.type) is not None else None
            self._ops[node.type] = op
            return op

    def resolve(self, n: VNode, op: OpDef) -> dict[str, Any]:
        """What `n.cfg` gives (the schema's `resolve` of the node's config), computed
        without caching it on the node: a freshly loaded network then keeps no dict
        per node that nobody asked for."""
        try:
            defaults = self._defaults[op.name]
        except KeyError:
            defaults = self._defaults[op.name] = op.schema.resolve({})
        cfg = dict(defaults)
        cfg.update(n.config)
        return cfg

    def run(self) -> None:
        graph, sink, done = self.graph, self.sink, self.done
        tied: list[tuple[VNode, dict[str, tuple[str, tuple[int, ...]]]]] = []
        in_order = True  # every node so far was fed only by nodes before it
        prefix = 0
        for n, slots, users in graph.adjacency():
            op = self.op(n)
            cfg = self.resolve(n, op) if op is not None else None
            self.check_node(n, op, cfg, slots, users, tied)
            if in_order:
                srcs = {}
                for e in slots.values():
                    outs = done.get(e.src, _UNSEEN)
                    if outs is _UNSEEN:
                        in_order = False
                        break
                    srcs[e.dst_slot] = outs
                else:
                    self.infer_node(n, op, cfg, slots, srcs)
                    prefix += 1
        self.check_ties(tied)
        acyclic = True
        if not in_order:
            # The earliest-inserted-first topological order starts with the nodes
            # inferred above, in the same order; carry on from there.
            order = graph.topo_ids()
            if order is None:
                acyclic = False
                sink.items.append(graph.cycle_diagnostic())
            else:
                inputs_of = graph.input_index()
                for node_id in order[prefix:]:
                    n = graph.node(node_id)
                    op = self.op(n)
                    slots = inputs_of[node_id]
                    self.infer_node(n, op, self.resolve(n, op) if op is not None else None, slots,
                                    {e.dst_slot: done[e.src] for e in slots.values()})
        if acyclic:
            sink.items.extend(self.inference)
        # With a cycle nothing counts as inferred, so endpoints are checked as far as
        # the definitions alone allow.
        self.check_endpoints(self.unknown if acyclic else self.broken)

    # -- every node, in file order ------------------------------------------------------
    def check_node(self, n: VNode, op: OpDef | None, cfg: Mapping[str, Any] | None,
                   slots: Mapping[int, Edge], users: Mapping[str, Sequence[Edge]], tied: list) -> None:
        """Type, input slots of its incoming edges, output slots of its outgoing ones,
        the weight it publishes."""
        node_id, sink = n.id, self.sink
        if not (node_id.isprintable() and 0 < len(node_id) <= MAX_ID_CHARS) or node_id[0] == " " \
                or node_id[-1] == " ":
            sink.error(id_problem(node_id) or "invalid node id", n.loc, node_id)
        if op is None:
            if node_id not in self.skip:
                sink.error(f"unknown node type {n.type!r}", n.loc, node_id)
            self.mark_broken(node_id)
        elif op.advice is not None and node_id not in self.skip:
            for text in op.advice(cfg):  # type: ignore[arg-type]
                sink.warning(text, n.loc, node_id)
        elif node_id not in self.skip:
            hi = op.input_range()[1]
            if hi is not None:
                for e in slots.values():
                    if e.dst_slot >= hi:
                        sink.error(f"edge {e}: input slot {e.dst_slot} is out of range ({n.type} "
                                   f"takes {hi} input{'s' * (hi != 1)})", e.loc or n.loc, node_id)
                        self.mark_broken(node_id)
            if users:
                n_out = op.outputs_for(cfg)  # type: ignore[arg-type]
                for parallel in users.values():
                    for e in parallel:
                        if e.src_slot >= n_out:
                            self.bad_output_slot(n, e, n_out)
        alias = n.config.get("shared_weight_alias")
        if alias:
            self.check_publisher(n, op, cfg, alias)
        if op is not None and op.tied_params is not None:
            ties = op.tied(cfg)  # type: ignore[arg-type]
            if ties:
                tied.append((n, ties))

    def mark_broken(self, node_id: str) -> None:
        self.broken.add(node_id)
        self.unknown.add(node_id)

    def bad_output_slot(self, src: VNode, e: Edge, n_out: int) -> None:
        loc = e.loc or self.graph.node(e.dst).loc
        self.sink.error(f"edge {e}: output slot {e.src_slot} is out of range ({src.type} "
                        f"'{e.src}' has {n_out} output{'s' * (n_out != 1)})", loc, e.dst)
        self.mark_broken(e.dst)

    def check_publisher(self, n: VNode, op: OpDef | None, cfg: Mapping[str, Any] | None,
                        alias: str) -> None:
        publishers = self.publishers
        first = publishers.get(alias)
        if first is not None:
            self.sink.error(f"shared_weight_alias {alias!r} is already published by '{first.id}'"
                            + (f" (line {first.loc.line})" if first.loc else ""), n.loc, n.id)
        else:
            publishers[alias] = n
        if op is not None and n.id not in self.broken and "weight" not in op.param_shapes(cfg):  # type: ignore
            self.sink.error(f"shared_weight_alias {alias!r}: a {n.type} has no weight to publish",
                            n.loc, n.id)

    # -- readers of tied weights, once every publisher is known ----------------------
    def check_ties(self, tied: list[tuple[VNode, dict[str, tuple[str, tuple[int, ...]]]]]) -> None:
        broken, publishers = self.broken, self.publishers
        for n, ties in tied:
            if n.id in broken:
                continue
            for pname, (alias, shape) in ties.items():
                pub = publishers.get(alias)
                if pub is None:
                    self.sink.error(f"tie_weight_alias {alias!r} has no publisher (no node sets "
                                    f"shared_weight_alias: {alias!r})", n.loc, n.id)
                    continue
                if pub.id in broken:
                    continue
                pub_op = self.op(pub)
                have = pub_op.param_shapes(self.resolve(pub, pub_op)).get("weight")  # type: ignore[arg-type]
                if have is not None and tuple(have) != tuple(shape):
                    self.sink.error(f"tied {pname} needs shape {list(shape)} but '{pub.id}' publishes "
                                    f"{alias!r} with shape {list(have)}", n.loc, n.id)

    # -- types, in topological order ----------------------------------------------------
    def report(self, message: str, loc: Any, node: str) -> None:
        self.inference.append(Diagnostic(message, loc, node))

    def infer_node(self, n: VNode, op: OpDef | None, cfg: Mapping[str, Any] | None,
                   slots: Mapping[int, Edge], srcs: dict[int, Outputs | None]) -> None:
        """Infer the node's output types from `srcs` (input slot -> outputs of the node
        feeding it); a node that fails, or is fed by one that did, joins `unknown`."""
        node_id = n.id
        ok = node_id not in self.unknown and None not in srcs.values()
        outs = self.infer_types(n, op, cfg, slots, srcs) if ok else None  # type: ignore[arg-type]
        if outs is None:
            self.unknown.add(node_id)
            self.done[node_id] = None
        else:
            n.outputs = self.done[node_id] = tuple(outs)

    def infer_types(self, n: VNode, op: OpDef, cfg: Mapping[str, Any], slots: Mapping[int, Edge],
                    srcs: dict[int, Outputs]) -> list[TensorType] | None:
        lo = op.input_range()[0]
        count = max(lo, max(slots) + 1) if slots else lo
        dtype = self.graph.activation_dtype(n)
        ins: list[TensorType | None] = []
        ok = True
        for slot in range(count):
            t = self.input_type(n, op, cfg, slot, slots.get(slot), srcs.get(slot), ins, dtype)
            if t is None:
                ok = False
            ins.append(t)
        if not ok:
            return None
        try:
            outs = op.infer(InferCtx(cfg, ins, dtype, lambda slot: self.producer(slots, slot)))  # type: ignore
        except ShapeError as exc:
            self.report(f"{exc}{_arriving(slots, ins)}", n.loc, n.id)
            return None
        except (KeyError, TypeError, ValueError, ZeroDivisionError, IndexError) as exc:
            self.report(f"cannot infer output types: {exc!r}{_arriving(slots, ins)}", n.loc, n.id)
            return None
        if self.contradicts_declared(n, cfg, outs):
            return None
        return outs

    def producer(self, slots: Mapping[int, Edge], slot: int) -> tuple[str, str, dict[str, Any]] | None:
        """(id, type, resolved config) of the VNode feeding `slot`, for an inference rule that asks."""
        edge = slots.get(slot)
        if edge is None:
            return None
        src = self.graph.node(edge.src)
        op = self.op(src)
        return None if op is None else (src.id, op.name, self.resolve(src, op))

    def input_type(self, n: VNode, op: OpDef, cfg: Mapping[str, Any], slot: int, edge: Edge | None,
                   src_outputs: Outputs | None, known: list[TensorType | None],
                   dtype: str) -> TensorType | None:
        """The type arriving at an input; None if it cannot be known (reported here)."""
        declared = None
        if n.input_shapes is not None and slot < len(n.input_shapes):
            declared = n.input_shapes[slot]
        elif slot == 0 and cfg.get("input_shape"):
            declared = tuple(cfg["input_shape"])
        want = op.kind_of_input(cfg, slot)  # type: ignore[arg-type]
        if edge is not None:
            assert src_outputs is not None  # a failed source stops inference earlier
            if edge.src_slot >= len(src_outputs):
                self.report(f"input {slot}: '{edge.src}' inferred only {len(src_outputs)} outputs "
                            f"but the edge reads output {edge.src_slot}", edge.loc or n.loc, n.id)
                return None
            t = src_outputs[edge.src_slot]
            if want != "any" and t.kind != want:
                self.report(f"input {slot} expects {want} data but receives {t} from "
                            f"'{edge.src}' output {edge.src_slot}", edge.loc or n.loc, n.id)
                return None
            if declared is not None and tuple(declared) != t.shape:
                self.report(f"declared input shape {list(declared)} for input {slot} contradicts "
                            f"{list(t.shape)} arriving from '{edge.src}' output {edge.src_slot}",
                            n.loc, n.id)
                return None
            return t
        if declared is not None:
            return TensorType(tuple(declared), _KIND_DTYPE.get(want, dtype))
        if op.network_input is not None:
            t = op.network_input(cfg, slot, known)  # type: ignore[arg-type]
            if t is not None:
                return t
        self.report(f"input {slot} is not connected and its shape cannot be known: connect an edge "
                    f"or declare input_shapes", n.loc, n.id)
        return None

    def contradicts_declared(self, n: VNode, cfg: Mapping[str, Any], outs: list[TensorType]) -> bool:
        declared = n.output_shapes
        if declared is None and cfg.get("output_shape"):
            declared = (tuple(cfg["output_shape"]),)
        if declared is None:
            return False
        if len(declared) > len(outs):
            self.report(f"output_shapes declares {len(declared)} outputs but a {n.type} has "
                        f"{len(outs)}", n.loc, n.id)
            return True
        bad = False
        for slot, shape in enumerate(declared):
            if tuple(shape) != outs[slot].shape:
                self.report(f"declared output shape {list(shape)} for output {slot} contradicts the "
                            f"inferred {list(outs[slot].shape)}", n.loc, n.id)
                bad = True
        return bad

    # -- outputs, costs, metrics ------------------------------------------------------
    def check_endpoints(self, unknown: set[str]) -> None:
        graph, sink = self.graph, self.sink
        for kind, eps in graph.endpoints.items():
            seen: dict[str, Endpoint] = {}
            for ep in eps:
                first = seen.get(ep.name)
                if first is not None:
                    at = f" (first at line {first.loc.line})" if first.loc else ""
                    sink.error(f"duplicate name {ep.name!r} in '{kind}'{at}", ep.loc, ep.node)
                else:
                    seen[ep.name] = ep
                if kind == "metrics" and ep.type not in METRIC_TYPES:
                    sink.error(f"metric {ep.name!r} has unknown type {ep.type!r} (expected learning_rate, "
                               f"loss or grad_norm)", ep.loc, ep.node)
                if ep.node not in graph:
                    sink.error(f"'{kind}' entry {ep.name!r} refers to unknown node {ep.node!r}",
                               ep.loc, ep.node)
                    continue
                if ep.node in unknown:
                    continue
                n = graph.node(ep.node)
                op = self.op(n)
                n_out = op.outputs_for(self.resolve(n, op))  # type: ignore[arg-type, union-attr]
                if ep.slot >= n_out:
                    sink.error(f"'{kind}' entry {ep.name!r} reads output slot {ep.slot} but a {n.type} "
                               f"has {n_out} output{'s' * (n_out != 1)}", ep.loc, ep.node)
                elif kind == "costs" and ep.slot < len(n.outputs) and n.outputs[ep.slot].shape != ():
                    sink.error(f"cost {ep.name!r} must be a scalar, but output {ep.slot} has shape "
                               f"{list(n.outputs[ep.slot].shape)}", ep.loc, ep.node)


def _arriving(slots: Mapping[int, Edge], ins: list[TensorType | None]) -> str:
    """What each connected input receives and from where: a mismatch names both ends."""
    parts = [f"input {slot} receives {ins[slot]} from '{e.src}' output {e.src_slot}"
             for slot, e in sorted(slots.items()) if slot < len(ins)]
    return f" ({'; '.join(parts)})" if parts else ""


class ValidationError(VGraphError):
    pass
