"""Network YAML <-> IR.

Loading composes the YAML into nodes (never constructing Python objects, so no
tag can run code) and reads scalars as their text: `512` and `"512"` are the
same config value.  Every node, edge and endpoint keeps the line it came from.
Problems found while reading are collected, then semantic validation runs on
what could be built, and all diagnostics are raised together.

Writing produces the spec's format: config values as quoted strings, shapes
per sample, slots written only when not 0.
"""
from __future__ import annotations

import gc
import json
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable

import yaml

from .diagnostics import Diagnostic, DiagnosticSink, SourceLoc, VGraphError, sorted_diagnostics
from .ir import ENDPOINT_KINDS, Endpoint, Graph, GraphError, VNode
from .ops import REGISTRY
from .ops.schema import ConfigError, Field, _parse_int, suggest

# The base loader resolves no implicit types: every plain scalar arrives as text
# (what we want: config values are strings), and composing is several times
# faster than with the safe loader's resolver.  Explicit tags are still seen.
_Loader = getattr(yaml, "CBaseLoader", yaml.BaseLoader)
_STD = "tag:yaml.org,2002:"
_SAFE_TAGS = {_STD + t for t in ("str", "int", "float", "bool", "null", "map", "seq", "timestamp")}
_NULLS = ("", "~", "null", "Null", "NULL")


def _is_null(ynode: yaml.Node) -> bool:
    return ynode.tag == _STD + "null" or (
        isinstance(ynode, yaml.ScalarNode) and ynode.style is None and ynode.value in _NULLS)
NETWORK_KEYS = ("name", "precision", "param_precision", "activation_precision",
                "nodes", "edges", "outputs", "costs", "metrics")
_PRECISION_FIELD = Field("precision", "precision")
NODE_KEYS = ("id", "type", "config", "input_shapes", "output_shapes")
EDGE_KEYS = ("from", "to", "from_slot", "to_slot")


class _Reader:
    """Walks composed YAML nodes, reporting problems with their line."""

    def __init__(self, file: str, sink: DiagnosticSink) -> None:
        self.file = file
        self.sink = sink

    def loc(self, ynode: yaml.Node) -> SourceLoc:
        return SourceLoc(self.file, ynode.start_mark.line + 1)

    def error(self, ynode: yaml.Node, msg: str, node: str | None = None) -> None:
        self.sink.error(msg, self.loc(ynode), node)

    def safe(self, ynode: yaml.Node, node: str | None = None) -> bool:
        """Refuse any tag outside YAML's core schema (e.g. !!python/object)."""
        if ynode.tag not in _SAFE_TAGS:
            self.error(ynode, f"unsafe or unsupported YAML tag {ynode.tag!r}: only plain "
                              f"mappings, lists and scalars are allowed", node)
            return False
        return True

    def mapping(self, ynode: yaml.Node, what: str, node: str | None = None
                ) -> dict[str, tuple[yaml.Node, yaml.Node]] | None:
        """key -> (key node, value node); None (with an error) if not a mapping."""
        if not self.safe(ynode, node):
            return None
        if not isinstance(ynode, yaml.MappingNode):
            self.error(ynode, f"{what} must be a mapping, got {_kind(ynode)}", node)
            return None
        out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for k, v in ynode.value:
            if not self.safe(k, node) or not isinstance(k, yaml.ScalarNode):
                if isinstance(k, yaml.Node) and k.tag in _SAFE_TAGS:
                    self.error(k, f"{what} keys must be plain strings", node)
                continue
            if k.value in out:
                self.error(k, f"duplicate key {k.value!r} in {what} (first at line "
                              f"{out[k.value][0].start_mark.line + 1})", node)
                continue
            out[k.value] = (k, v)
        return out

    def sequence(self, ynode: yaml.Node, what: str) -> list[yaml.Node]:
        if not self.safe(ynode):
            return []
        if _is_null(ynode):
            return []
        if not isinstance(ynode, yaml.SequenceNode):
            self.error(ynode, f"'{what}' must be a list, got {_kind(ynode)}")
            return []
        return list(ynode.value)

    def scalar(self, ynode: yaml.Node, what: str, node: str | None = None) -> str | None:
        if not self.safe(ynode, node):
            return None
        if not isinstance(ynode, yaml.ScalarNode):
            self.error(ynode, f"{what} must be a single value, got {_kind(ynode)}", node)
            return None
        if _is_null(ynode):
            self.error(ynode, f"{what} is empty", node)
            return None
        return ynode.value

    def integer(self, ynode: yaml.Node, what: str, node: str | None = None) -> int | None:
        text = self.scalar(ynode, what, node)
        if text is None:
            return None
        try:
            value = _parse_int(text)
        except ConfigError:
            self.error(ynode, f"{what} must be an integer, got {text!r}", node)
            return None
        if value < 0:
            self.error(ynode, f"{what} must be >= 0, got {value}", node)
            return None
        return value

    def shapes(self, ynode: yaml.Node, what: str, node: str) -> tuple[tuple[int, ...], ...] | None:
        """A list of per-sample shapes, e.g. [[128], [128, 512]]."""
        out = []
        for item in self.sequence(ynode, what):
            if not self.safe(item, node) or not isinstance(item, yaml.SequenceNode):
                self.error(item, f"each entry of {what} must be a list of dimensions", node)
                return None
            dims = [self.integer(d, f"a dimension in {what}", node) for d in item.value]
            if any(d is None for d in dims):
                return None
            if any(d == 0 for d in dims):
                self.error(item, f"dimensions in {what} must be positive, got {dims}", node)
                return None
            out.append(tuple(dims))
        return tuple(out)

    def plain(self, ynode: yaml.Node) -> Any:
        """A value vgraph does not interpret, kept for writing back (safe tags only)."""
        if not self.safe(ynode):
            return None
        if isinstance(ynode, yaml.MappingNode):
            return {k.value: self.plain(v) for k, v in ynode.value if isinstance(k, yaml.ScalarNode)}
        if isinstance(ynode, yaml.SequenceNode):
            return [self.plain(v) for v in ynode.value]
        return yaml.safe_load(yaml.serialize(yaml.ScalarNode(
            ynode.tag, ynode.value, style=ynode.style or None)) if ynode.style else ynode.value)


def _kind(ynode: yaml.Node) -> str:
    if isinstance(ynode, yaml.MappingNode):
        return "a mapping"
    if isinstance(ynode, yaml.SequenceNode):
        return "a list"
    return f"{ynode.value!r}"


def loads(text: str, file: str = "<string>", *, validate: bool = True,
          warnings: list[Diagnostic] | None = None) -> Graph:
    """Parse network YAML text; raise VGraphError listing every problem.

    With `validate` (the default) the graph is also verified and its types
    inferred.  Warnings (e.g. unknown top-level keys) go into `warnings`.
    """
    from .verify import check

    sink = DiagnosticSink()
    with _no_gc():
        graph, broken = _read(text, file, sink)
        if graph is not None and validate:
            check(graph, sink, skip=broken)
    sink.raise_if_errors()
    if warnings is not None:
        warnings.extend(d for d in sink.items if d.severity == "warning")
    assert graph is not None  # no graph means a reported error
    return graph


@contextmanager
def _no_gc():
    """Pause the cyclic GC while building a large graph.

    Loading allocates millions of small acyclic objects; the generational
    collector would rescan the growing heap again and again, which made load
    time grow quadratically (10k VNodes: 1.9 s with GC, a tenth without).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def load(path: str | Path, *, validate: bool = True,
         warnings: list[Diagnostic] | None = None) -> Graph:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise VGraphError([Diagnostic(f"cannot read file: {reason}", SourceLoc(str(path), 1))]) from None
    return loads(text, str(path), validate=validate, warnings=warnings)


def _read(text: str, file: str, sink: DiagnosticSink) -> tuple[Graph | None, set[str]]:
    try:
        root = yaml.compose(text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        sink.error(f"YAML syntax error: {exc.problem or exc.context}", SourceLoc(file, line))
        return None, set()
    except yaml.YAMLError as exc:
        sink.error(f"YAML error: {exc}", SourceLoc(file, 1))
        return None, set()
    if root is None:
        sink.error("empty file: expected a network mapping with 'nodes' and 'edges'", SourceLoc(file, 1))
        return None, set()
    r = _Reader(file, sink)
    top = r.mapping(root, "the document (a network)")
    if top is None:
        return None, set()
    graph = Graph(source=file)
    if "name" in top:
        graph.name = r.scalar(top["name"][1], "'name'") or graph.name
    for key in ("precision", "param_precision", "activation_precision"):
        if key in top:
            text_value = r.scalar(top[key][1], f"'{key}'")
            if text_value is not None:
                try:
                    graph.attrs[key] = _PRECISION_FIELD.parse(text_value)
                except ConfigError as exc:
                    r.error(top[key][1], f"'{key}': {exc}")
    for key, (kn, vn) in top.items():
        if key not in NETWORK_KEYS:
            sink.warning(f"unknown top-level key {key!r}{suggest(key, NETWORK_KEYS)}: "
                         f"kept as is, not interpreted", r.loc(kn))
            graph.extra[key] = r.plain(vn)
    if "nodes" not in top:
        r.error(root, "the network has no 'nodes' list")
    broken: set[str] = set()
    for item in r.sequence(top["nodes"][1], "nodes") if "nodes" in top else []:
        _read_node(r, item, graph, broken)
    for item in r.sequence(top["edges"][1], "edges") if "edges" in top else []:
        _read_edge(r, item, graph)
    for kind in ENDPOINT_KINDS:
        for item in r.sequence(top[kind][1], kind) if kind in top else []:
            _read_endpoint(r, item, graph, kind)
    return graph, broken


def _read_node(r: _Reader, item: yaml.Node, graph: Graph, broken: set[str]) -> None:
    m = r.mapping(item, "a node")
    if m is None:
        return
    node_id = r.scalar(m["id"][1], "'id'") if "id" in m else None
    if node_id is None:
        if "id" not in m:
            r.error(item, "node has no 'id'")
        return
    for key, (kn, _) in m.items():
        if key not in NODE_KEYS:
            r.error(kn, f"unknown node key {key!r}{suggest(key, NODE_KEYS)}", node_id)
    loc = r.loc(item)
    type_text = r.scalar(m["type"][1], "'type'", node_id) if "type" in m else None
    if "type" not in m:
        r.error(item, "node has no 'type'", node_id)
    canon = REGISTRY.canonical(type_text) if type_text is not None else None
    if type_text is not None and canon is None:
        r.error(m["type"][1], f"unknown node type {type_text!r}{suggest(type_text, REGISTRY.aliases())}",
                node_id)
    raw: dict[str, str] = {}
    lines: dict[str, yaml.Node] = {}
    ok = canon is not None
    if "config" in m:
        cfg = r.mapping(m["config"][1], "'config'", node_id)
        ok = ok and cfg is not None
        for key, (kn, vn) in (cfg or {}).items():
            value = r.scalar(vn, f"config {key!r}", node_id)
            if value is None:
                ok = False
            else:
                raw[key], lines[key] = value, vn
    node = VNode(node_id, canon or str(type_text), loc=loc)
    if canon is not None:
        values, problems = REGISTRY.get(canon).schema.parse(raw)
        node.config = values
        for key, problem in problems:
            r.error(lines.get(key, item), problem, node_id)
            ok = False
    for key in ("input_shapes", "output_shapes"):
        if key in m:
            shapes = r.shapes(m[key][1], f"'{key}'", node_id)
            ok = ok and shapes is not None
            setattr(node, key, shapes)
    try:
        graph.add_node(node)
    except GraphError:
        first = graph.node(node_id).loc
        r.error(item, f"duplicate node id (first defined at line {first.line})" if first
                else "duplicate node id", node_id)
        return
    if not ok:
        broken.add(node_id)


def _read_edge(r: _Reader, item: yaml.Node, graph: Graph) -> None:
    m = r.mapping(item, "an edge")
    if m is None:
        return
    for key, (kn, _) in m.items():
        if key not in EDGE_KEYS:
            r.error(kn, f"unknown edge key {key!r}{suggest(key, EDGE_KEYS)}")
    ends = {}
    for key in ("from", "to"):
        if key not in m:
            r.error(item, f"edge has no '{key}'")
            return
        ends[key] = r.scalar(m[key][1], f"edge '{key}'")
    slots = {k: (r.integer(m[k][1], f"edge '{k}'", ends.get("to")) if k in m else 0)
             for k in ("from_slot", "to_slot")}
    if None in ends.values() or None in slots.values():
        return
    src, dst = ends["from"], ends["to"]
    for end, key in ((src, "from"), (dst, "to")):
        if end not in graph:
            other = dst if key == "from" else src
            r.error(m[key][1], f"edge {src} -> {dst}: '{key}' names unknown node {end!r}"
                               f"{suggest(end, (n.id for n in graph.nodes))}",
                    other if other in graph else None)
            return
    try:
        graph.add_edge(src, slots["from_slot"], dst, slots["to_slot"], r.loc(item))
    except GraphError as exc:
        r.sink.items.extend(exc.diagnostics)


def _read_endpoint(r: _Reader, item: yaml.Node, graph: Graph, kind: str) -> None:
    m = r.mapping(item, f"an entry of '{kind}'")
    if m is None:
        return
    allowed = ("name", "node_id", "slot_id") + (("type",) if kind == "metrics" else ())
    for key, (kn, _) in m.items():
        if key not in allowed:
            r.error(kn, f"unknown key {key!r} in '{kind}'{suggest(key, allowed)}")
    fields = {}
    for key in ("name", "node_id"):
        if key not in m:
            r.error(item, f"entry of '{kind}' has no '{key}'")
            return
        fields[key] = r.scalar(m[key][1], f"'{key}'")
    slot = r.integer(m["slot_id"][1], "'slot_id'", fields["node_id"]) if "slot_id" in m else 0
    mtype = r.scalar(m["type"][1], "'type'") if "type" in m else None
    if None in fields.values() or slot is None:
        return
    graph.endpoints[kind].append(Endpoint(fields["name"], fields["node_id"], slot, mtype, r.loc(item)))


# -- writing -------------------------------------------------------------------------

_PLAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-/]*$")
_RESERVED = {"true", "false", "yes", "no", "on", "off", "null", "y", "n"}


def _s(text: str) -> str:
    """A YAML scalar for an identifier: plain when unambiguous, else double-quoted."""
    if _PLAIN.match(text) and text.lower() not in _RESERVED:
        return text
    return json.dumps(text, ensure_ascii=False)


def _q(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _shapes(shapes: Iterable[tuple[int, ...]]) -> str:
    return "[" + ", ".join("[" + ", ".join(map(str, s)) + "]" for s in shapes) + "]"


def dumps(graph: Graph) -> str:
    """The network as spec-format YAML text."""
    out: list[str] = [f"name: {_s(graph.name)}"]
    for key in ("precision", "param_precision", "activation_precision"):
        if key in graph.attrs:
            out.append(f"{key}: {graph.attrs[key]}")
    out.append("nodes:" if len(graph) else "nodes: []")
    for n in graph.nodes:
        out.append(f"  - id: {_s(n.id)}")
        out.append(f"    type: {_s(n.type)}")
        if n.config:
            out.append("    config:")
            for key, value in n.config.items():
                out.append(f"      {_s(key)}: {_q(Field.format(value))}")
        if n.input_shapes is not None:
            out.append(f"    input_shapes: {_shapes(n.input_shapes)}")
        if n.output_shapes is not None:
            out.append(f"    output_shapes: {_shapes(n.output_shapes)}")
    edges = graph.edges
    out.append("edges:" if edges else "edges: []")
    for e in edges:
        line = f"  - {{from: {_s(e.src)}, to: {_s(e.dst)}"
        if e.src_slot:
            line += f", from_slot: {e.src_slot}"
        if e.dst_slot:
            line += f", to_slot: {e.dst_slot}"
        out.append(line + "}")
    for kind in ENDPOINT_KINDS:
        eps = graph.endpoints[kind]
        if not eps:
            continue
        out.append(f"{kind}:")
        for ep in eps:
            extra = f", type: {_s(ep.type)}" if ep.type else ""
            out.append(f"  - {{name: {_s(ep.name)}, node_id: {_s(ep.node)}, slot_id: {ep.slot}{extra}}}")
    if graph.extra:
        out.append(yaml.safe_dump(graph.extra, sort_keys=False, default_flow_style=False).rstrip("\n"))
    return "\n".join(out) + "\n"


def save(graph: Graph, path: str | Path) -> None:
    """Write atomically: a reader never sees a half-written network."""
    import os
    import tempfile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(dumps(graph))
    os.replace(tmp, path)


__all__ = ["load", "loads", "dumps", "save", "sorted_diagnostics"]
