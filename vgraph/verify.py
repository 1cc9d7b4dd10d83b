"""Semantic validation and type inference over a Graph.

`check` walks the graph once in topological order, inferring every output
type, and reports all problems it sees (arity, slots, unconnected inputs,
shape and dtype disagreement along edges, declared shapes that contradict
inference, weight aliases, outputs/costs/metrics).  A node whose own
definition is broken is skipped, and so is whatever depends on it, so one
mistake does not produce a cascade of messages.
"""
from __future__ import annotations

from typing import Iterable

from .diagnostics import DiagnosticSink, VGraphError, sorted_diagnostics
from .ir import Graph, VNode
from .ops import REGISTRY, InferCtx
from .types import ShapeError, TensorType

_KIND_DTYPE = {"int": "int64", "str": "string"}


def verify(graph: Graph) -> Graph:
    """Raise VGraphError with every problem; on success the types are inferred."""
    sink = DiagnosticSink()
    check(graph, sink)
    sink.raise_if_errors()
    return graph


def problems(graph: Graph) -> list:
    sink = DiagnosticSink()
    check(graph, sink)
    return sorted_diagnostics(d for d in sink.items if d.severity == "error")


def check(graph: Graph, sink: DiagnosticSink, skip: Iterable[str] = ()) -> None:
    unknown = set(skip)
    for n in graph.nodes:
        if REGISTRY.canonical(n.type) is None:
            if n.id not in unknown:
                sink.error(f"unknown node type {n.type!r}", n.loc, n.id)
            unknown.add(n.id)
    _check_edges(graph, sink, unknown)
    _check_aliases(graph, sink, unknown)
    if graph.is_acyclic():
        _infer(graph, sink, unknown)
    else:
        sink.items.append(graph.cycle_diagnostic())
    _check_endpoints(graph, sink, unknown)


def _check_edges(graph: Graph, sink: DiagnosticSink, unknown: set[str]) -> None:
    for e in graph.edges:
        src, dst = graph.node(e.src), graph.node(e.dst)
        if e.src not in unknown and e.src_slot >= src.num_outputs:
            sink.error(f"edge {e}: output slot {e.src_slot} is out of range ({src.type} "
                       f"'{e.src}' has {src.num_outputs} output{'s' * (src.num_outputs != 1)})",
                       e.loc or dst.loc, e.dst)
            unknown.add(e.dst)
        if e.dst not in unknown:
            _, hi = dst.op.input_range()
            if hi is not None and e.dst_slot >= hi:
                sink.error(f"edge {e}: input slot {e.dst_slot} is out of range ({dst.type} takes "
                           f"{hi} input{'s' * (hi != 1)})", e.loc or dst.loc, e.dst)
                unknown.add(e.dst)


def _check_aliases(graph: Graph, sink: DiagnosticSink, unknown: set[str]) -> None:
    publishers: dict[str, VNode] = {}
    for n in graph.nodes:
        alias = n.config.get("shared_weight_alias")
        if not alias:
            continue
        if alias in publishers:
            first = publishers[alias]
            sink.error(f"shared_weight_alias {alias!r} is already published by '{first.id}'"
                       + (f" (line {first.loc.line})" if first.loc else ""), n.loc, n.id)
        else:
            publishers[alias] = n
        if n.id not in unknown and "weight" not in n.op.param_shapes(n.cfg):
            sink.error(f"shared_weight_alias {alias!r}: a {n.type} has no weight to publish", n.loc, n.id)
    for n in graph.nodes:
        if n.id in unknown:
            continue
        for pname, (alias, shape) in n.op.tied(n.cfg).items():
            pub = publishers.get(alias)
            if pub is None:
                sink.error(f"tie_weight_alias {alias!r} has no publisher (no node sets "
                           f"shared_weight_alias: {alias!r})", n.loc, n.id)
                continue
            if pub.id in unknown:
                continue
            have = pub.op.param_shapes(pub.cfg).get("weight")
            if have is not None and tuple(have) != tuple(shape):
                sink.error(f"tied {pname} needs shape {list(shape)} but '{pub.id}' publishes "
                           f"{alias!r} with shape {list(have)}", n.loc, n.id)


def _input_type(graph: Graph, n: VNode, slot: int, known: list[TensorType | None],
                dtype: str, sink: DiagnosticSink, unknown: set[str]) -> TensorType | None | bool:
    """The type arriving at an input; False if it cannot be known (reported or upstream)."""
    op, cfg = n.op, n.cfg
    declared = None
    if n.input_shapes is not None and slot < len(n.input_shapes):
        declared = n.input_shapes[slot]
    elif slot == 0 and cfg.get("input_shape"):
        declared = tuple(cfg["input_shape"])
    want = op.kind_of_input(cfg, slot)
    edge = graph.input_edge(n.id, slot)
    if edge is not None:
        if edge.src in unknown:
            return False
        t = graph.node(edge.src).outputs[edge.src_slot]
        if want != "any" and t.kind != want:
            sink.error(f"input {slot} expects {want} data but receives {t} from "
                       f"'{edge.src}' output {edge.src_slot}", edge.loc or n.loc, n.id)
            return False
        if declared is not None and tuple(declared) != t.shape:
            sink.error(f"declared input shape {list(declared)} for input {slot} contradicts "
                       f"{list(t.shape)} arriving from '{edge.src}' output {edge.src_slot}",
                       n.loc, n.id)
            return False
        return t
    if declared is not None:
        return TensorType(tuple(declared), _KIND_DTYPE.get(want, dtype))
    if op.network_input is not None:
        t = op.network_input(cfg, slot, known)
        if t is not None:
            return t
    sink.error(f"input {slot} is not connected and its shape cannot be known: connect an edge "
               f"or declare input_shapes", n.loc, n.id)
    return False


def _infer(graph: Graph, sink: DiagnosticSink, unknown: set[str]) -> None:
    for n in graph.topo_order():
        if n.id in unknown:
            continue
        if any(e.src in unknown for e in graph.in_edges(n.id)):
            unknown.add(n.id)
            continue
        lo, hi = n.op.input_range()
        count = graph.num_inputs(n.id)
        dtype = graph.activation_dtype(n)
        ins: list[TensorType | None] = []
        ok = True
        for slot in range(count):
            t = _input_type(graph, n, slot, ins, dtype, sink, unknown)
            if t is False:
                ok = False
                t = None
            ins.append(t)  # type: ignore[arg-type]
        if not ok:
            unknown.add(n.id)
            continue
        try:
            outs = n.op.infer(InferCtx(n.cfg, ins, dtype))  # type: ignore[arg-type]
        except ShapeError as exc:
            sink.error(str(exc), n.loc, n.id)
            unknown.add(n.id)
            continue
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            sink.error(f"cannot infer output types: {exc!r}", n.loc, n.id)
            unknown.add(n.id)
            continue
        if _contradicts_declared(n, outs, sink):
            unknown.add(n.id)
            continue
        n.outputs = tuple(outs)


def _contradicts_declared(n: VNode, outs: list[TensorType], sink: DiagnosticSink) -> bool:
    declared = n.output_shapes
    if declared is None and n.cfg.get("output_shape"):
        declared = (tuple(n.cfg["output_shape"]),)
    if declared is None:
        return False
    bad = False
    if len(declared) > len(outs):
        sink.error(f"output_shapes declares {len(declared)} outputs but a {n.type} has {len(outs)}",
                   n.loc, n.id)
        return True
    for slot, shape in enumerate(declared):
        if tuple(shape) != outs[slot].shape:
            sink.error(f"declared output shape {list(shape)} for output {slot} contradicts the "
                       f"inferred {list(outs[slot].shape)}", n.loc, n.id)
            bad = True
    return bad


def _check_endpoints(graph: Graph, sink: DiagnosticSink, unknown: set[str]) -> None:
    for kind, eps in graph.endpoints.items():
        seen: dict[str, int] = {}
        for ep in eps:
            if ep.name in seen:
                sink.error(f"duplicate name {ep.name!r} in '{kind}' (first at line {seen[ep.name]})",
                           ep.loc, ep.node)
            seen[ep.name] = ep.loc.line if ep.loc else 0
            if ep.node not in graph:
                sink.error(f"'{kind}' entry {ep.name!r} refers to unknown node {ep.node!r}", ep.loc, ep.node)
                continue
            n = graph.node(ep.node)
            if ep.node in unknown:
                continue
            if ep.slot >= n.num_outputs:
                sink.error(f"'{kind}' entry {ep.name!r} reads output slot {ep.slot} but a {n.type} "
                           f"has {n.num_outputs} output{'s' * (n.num_outputs != 1)}", ep.loc, ep.node)
            elif kind == "costs" and n.outputs and n.outputs[ep.slot].shape != ():
                sink.error(f"cost {ep.name!r} must be a scalar, but output {ep.slot} has shape "
                           f"{list(n.outputs[ep.slot].shape)}", ep.loc, ep.node)
            if kind == "metrics" and ep.type not in (None, "learning_rate", "loss", "grad_norm"):
                sink.error(f"metric {ep.name!r} has unknown type {ep.type!r} (expected learning_rate, "
                           f"loss or grad_norm)", ep.loc, ep.node)


class ValidationError(VGraphError):
    pass
