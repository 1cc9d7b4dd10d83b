"""Network YAML <-> IR.

Reading has two stages.  A *reader* turns the text into plain records (a
node's id, type text, config strings, each with the line it came from) and
reports everything malformed about the document's structure.  One *builder*
then turns records into the IR and reports what is wrong with their meaning
(unknown types, bad config values, duplicate ids, dangling edges).  Semantic
validation (`vgraph.verify`) runs last, and all diagnostics are raised
together.

There are two readers with the same output:

- the general one composes the text with PyYAML (never constructing Python
  objects, so no tag can run code) and reads scalars as their text, so `512`
  and `"512"` are the same config value;
- a fast one (`_read_fast`) recognises exactly the canonical layout that
  `dumps` writes, with a few regular expressions, and gives up on anything
  else, in which case the general reader runs.  Composing a 100k-VNode file
  with PyYAML alone takes seconds; the canonical layout is what vgraph and
  the generators write, so it is what large files look like.

Both must agree on everything the fast one accepts: the same graph, the same
lines, the same diagnostics (tests/test_properties.py checks it on valid and
mutated texts).

Writing produces the spec's format: config values as quoted strings, shapes
per sample, slots written only when not 0.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from sys import intern
from typing import Any, NamedTuple

import yaml

from .gcpause import paused_gc
from .diagnostics import Diagnostic, DiagnosticSink, SourceLoc, VGraphError, sorted_diagnostics
from .ir import ENDPOINT_KINDS, Edge, Endpoint, Graph, GraphError, VNode
from .ops import REGISTRY
from .ops.schema import ConfigError, Field, _parse_int, suggest

# The base loader resolves no implicit types: every plain scalar arrives as text
# (what we want: config values are strings), and composing is several times
# faster than with the safe loader's resolver.  Explicit tags are still seen.
_Loader = getattr(yaml, "CBaseLoader", yaml.BaseLoader)
_STD = "tag:yaml.org,2002:"
_SAFE_TAGS = {_STD + t for t in ("str", "int", "float", "bool", "null", "map", "seq", "timestamp")}
_NULLS = ("", "~", "null", "Null", "NULL")
NETWORK_KEYS = ("name", "precision", "param_precision", "activation_precision",
                "nodes", "edges", "outputs", "costs", "metrics")
PRECISION_KEYS = ("precision", "param_precision", "activation_precision")
_PRECISION_FIELD = Field("precision", "precision")
NODE_KEYS = ("id", "type", "config", "input_shapes", "output_shapes")
EDGE_KEYS = ("from", "to", "from_slot", "to_slot")
_MAX_PLAIN_NODES = 1_000_000  # uninterpreted top-level values: more YAML nodes than this is an alias bomb
_SUGGEST_LIMIT = 2_000  # "did you mean" over more node ids than this costs more than it helps
_SUGGESTIONS = 100  # ... and so does making more than this many of them for one file

Shapes = tuple[tuple[int, ...], ...]
ParsedConfig = tuple[dict[str, Any], list[tuple[str, str]]]  # what Schema.parse returns


# -- records: what a reader hands the builder -------------------------------------------

class NodeRec(NamedTuple):
    """One node as written.  Malformed parts were reported by the reader and left out."""

    id: str
    line: int
    type_text: str | None  # None: missing or not a scalar (reported)
    type_line: int
    raw: dict[str, str]  # config key -> text, the keys that could be read
    config_lines: dict[str, int] | int  # key -> line; an int is the first key's line, one key a line
    # One dict per distinct config text, shared by the records with that text: the
    # builder keeps its parse there (per node type).  None: no sharing known.
    config_memo: dict[str, ParsedConfig] | None
    input_shapes: Shapes | None
    output_shapes: Shapes | None
    ok: bool  # False: something in the definition was malformed (reported)


class EdgeRec(NamedTuple):
    src: str
    src_line: int
    dst: str
    dst_line: int
    src_slot: int
    dst_slot: int
    line: int


class EndpointRec(NamedTuple):
    kind: str
    name: str
    node: str
    slot: int
    type: str | None
    line: int


class _Builder:
    """Records -> IR, with the checks of meaning both readers share."""

    def __init__(self, file: str, sink: DiagnosticSink) -> None:
        self.file = file
        self.sink = sink
        self.graph = Graph(source=file)
        self.readable = True  # False: no network could be read at all (reported)
        self.broken: set[str] = set()
        # id -> (node, its input slots, its users): one lookup per edge end finds all three
        self._ends: dict[str, tuple[VNode, dict[int, Edge], dict[str, list[Edge]]]] = {}
        self._canon: dict[str, str | None] = {}
        self._suggestions_left = _SUGGESTIONS

    def loc(self, line: int) -> SourceLoc:
        return SourceLoc(self.file, line)

    def error(self, line: int, msg: str, node: str | None = None) -> None:
        self.sink.error(msg, SourceLoc(self.file, line), node)

    def name(self, text: str) -> None:
        self.graph.name = text

    def attr(self, key: str, text: str, line: int) -> None:
        try:
            self.graph.attrs[key] = _PRECISION_FIELD.parse(text)
        except ConfigError as exc:
            self.error(line, f"'{key}': {exc}")

    def node(self, rec: NodeRec) -> None:
        node_id, type_text = rec.id, rec.type_text
        canon = None
        if type_text is not None:
            try:
                canon = self._canon[type_text]
            except KeyError:
                canon = self._canon[type_text] = REGISTRY.canonical(type_text)
            if canon is None:
                self.error(rec.type_line, f"unknown node type {type_text!r}"
                                          f"{suggest(type_text, REGISTRY.aliases())}", node_id)
        ok = rec.ok and canon is not None
        loc = SourceLoc(self.file, rec.line)
        if canon is not None:
            values, problems = self._parse_config(canon, rec)
            node = VNode(node_id, canon, dict(values), rec.input_shapes, rec.output_shapes, loc)
            for key, problem in problems:
                self.error(_config_line(rec, key), problem, node_id)
                ok = False
        else:
            node = VNode(node_id, str(type_text), {}, rec.input_shapes, rec.output_shapes, loc)
        graph = self.graph
        try:
            inputs, users = graph._add(node)
        except GraphError:
            first = graph.node(node_id).loc
            self.error(rec.line, f"duplicate node id (first defined at line {first.line})" if first
                       else "duplicate node id", node_id)
            return
        self._ends[node_id] = (node, inputs, users)
        if not ok:
            self.broken.add(node_id)

    def _parse_config(self, canon: str, rec: NodeRec) -> ParsedConfig:
        """The schema's parse of the node's config, shared by records with the same text."""
        memo = rec.config_memo
        if memo is None:
            return REGISTRY.get(canon).schema.parse(rec.raw)
        try:
            return memo[canon]
        except KeyError:
            parsed = memo[canon] = REGISTRY.get(canon).schema.parse(rec.raw)
            return parsed

    def edge(self, rec: EdgeRec) -> None:
        graph = self.graph
        src_end, dst_end = self._ends.get(rec.src), self._ends.get(rec.dst)
        if src_end is None or dst_end is None:
            src, dst = rec.src, rec.dst
            for end, key, line in ((src, "from", rec.src_line), (dst, "to", rec.dst_line)):
                if end not in graph:
                    other = dst if key == "from" else src
                    self.error(line, f"edge {src} -> {dst}: '{key}' names unknown node {end!r}"
                                     f"{self._suggest_id(end)}", other if other in graph else None)
                    return
        src_node, _, users = src_end  # type: ignore[misc]
        dst_node, inputs, _ = dst_end  # type: ignore[misc]
        # The nodes' own id strings: the text's copies are dropped, and every later
        # lookup by an edge's end finds its key by identity.
        src, dst = src_node.id, dst_node.id
        busy = inputs.get(rec.dst_slot)
        if busy is not None:
            at = f" (first at line {busy.loc.line})" if busy.loc else ""
            self.error(rec.line, f"input slot {rec.dst_slot} already receives {busy}{at}; "
                                 f"an input takes at most one edge", dst)
            return
        graph._link(Edge(src, rec.src_slot, dst, rec.dst_slot, SourceLoc(self.file, rec.line)),
                    inputs, users)

    def _suggest_id(self, word: str) -> str:
        graph = self.graph
        if len(graph) > _SUGGEST_LIMIT or self._suggestions_left <= 0:
            return ""
        self._suggestions_left -= 1
        return suggest(word, list(graph.node_ids()))

    def endpoint(self, rec: EndpointRec) -> None:
        self.graph.endpoints[rec.kind].append(
            Endpoint(rec.name, rec.node, rec.slot, rec.type, SourceLoc(self.file, rec.line)))


def _config_line(rec: NodeRec, key: str) -> int:
    lines = rec.config_lines
    if isinstance(lines, int):
        return lines + list(rec.raw).index(key) if key in rec.raw else rec.line
    return lines.get(key, rec.line)


# -- the general reader: PyYAML's composer ------------------------------------------------

def _is_null(ynode: yaml.Node) -> bool:
    # The C composer gives plain scalars style '' and the Python one None.
    return ynode.tag == _STD + "null" or (
        isinstance(ynode, yaml.ScalarNode) and not ynode.style and ynode.value in _NULLS)


def _kind(ynode: yaml.Node) -> str:
    if isinstance(ynode, yaml.MappingNode):
        return "a mapping"
    if isinstance(ynode, yaml.SequenceNode):
        return "a list"
    return f"{ynode.value!r}"


def _line(ynode: yaml.Node) -> int:
    return ynode.start_mark.line + 1


class _YamlReader:
    """Walks composed YAML nodes, reporting structural problems with their line."""

    def __init__(self, build: _Builder) -> None:
        self.build = build
        self.sink = build.sink

    def error(self, ynode: yaml.Node, msg: str, node: str | None = None) -> None:
        self.build.error(_line(ynode), msg, node)

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
                if k.tag in _SAFE_TAGS:
                    self.error(k, f"{what} keys must be plain strings", node)
                continue
            if k.value in out:
                self.error(k, f"duplicate key {k.value!r} in {what} (first at line "
                              f"{_line(out[k.value][0])})", node)
                continue
            out[k.value] = (k, v)
        return out

    def sequence(self, ynode: yaml.Node, what: str) -> list[yaml.Node]:
        if not self.safe(ynode) or _is_null(ynode):
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

    def shapes(self, ynode: yaml.Node, what: str, node: str) -> Shapes | None:
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
        return tuple(out)  # type: ignore[arg-type]

    def plain(self, ynode: yaml.Node) -> Any:
        """A value vgraph does not interpret, kept as text for writing back.

        Iterative, and bounded in size: anchors and aliases let a few lines of
        YAML describe an exponentially large value.
        """
        budget = _MAX_PLAIN_NODES

        def convert(root: yaml.Node) -> Any:
            nonlocal budget
            result: list[Any] = []
            stack: list[tuple[yaml.Node, Any, Any]] = [(root, result, None)]
            while stack:
                yn, parent, key = stack.pop()
                budget -= 1
                if budget < 0:
                    raise _TooLarge
                if not self.safe(yn):
                    value: Any = None
                elif isinstance(yn, yaml.MappingNode):
                    value = {}
                    for k, v in reversed(yn.value):
                        if isinstance(k, yaml.ScalarNode):
                            stack.append((v, value, k.value))
                elif isinstance(yn, yaml.SequenceNode):
                    value = [None] * len(yn.value)
                    for i, v in enumerate(yn.value):
                        stack.append((v, value, i))
                else:
                    value = yn.value
                if key is None:
                    parent.append(value)
                else:
                    parent[key] = value  # a repeated mapping key: the last one wins
            return result[0]

        try:
            return convert(ynode)
        except _TooLarge:
            self.error(ynode, f"value too large (more than {_MAX_PLAIN_NODES:,} YAML nodes, "
                              f"e.g. through nested aliases)")
            return None

    # -- the document ------------------------------------------------------------------
    def read(self, root: yaml.Node) -> None:
        build = self.build
        top = self.mapping(root, "the document (a network)")
        if top is None:
            build.readable = False
            return
        if "name" in top:
            text = self.scalar(top["name"][1], "'name'")
            if text is not None:
                build.name(text)
        for key in PRECISION_KEYS:
            if key in top:
                text = self.scalar(top[key][1], f"'{key}'")
                if text is not None:
                    build.attr(key, text, _line(top[key][1]))
        for key, (kn, vn) in top.items():
            if key not in NETWORK_KEYS:
                self.sink.warning(f"unknown top-level key {key!r}{suggest(key, NETWORK_KEYS)}: "
                                  f"kept as is, not interpreted", build.loc(_line(kn)))
                build.graph.extra[key] = self.plain(vn)
        if "nodes" not in top:
            self.error(root, "the network has no 'nodes' list")
        for item in self.sequence(top["nodes"][1], "nodes") if "nodes" in top else []:
            rec = self.node(item)
            if rec is not None:
                build.node(rec)
        for item in self.sequence(top["edges"][1], "edges") if "edges" in top else []:
            erec = self.edge(item)
            if erec is not None:
                build.edge(erec)
        for kind in ENDPOINT_KINDS:
            for item in self.sequence(top[kind][1], kind) if kind in top else []:
                eprec = self.endpoint(item, kind)
                if eprec is not None:
                    build.endpoint(eprec)

    def node(self, item: yaml.Node) -> NodeRec | None:
        m = self.mapping(item, "a node")
        if m is None:
            return None
        node_id = self.scalar(m["id"][1], "'id'") if "id" in m else None
        if node_id is None:
            if "id" not in m:
                self.error(item, "node has no 'id'")
            return None
        for key, (kn, _) in m.items():
            if key not in NODE_KEYS:
                self.error(kn, f"unknown node key {key!r}{suggest(key, NODE_KEYS)}", node_id)
        type_text, type_line = None, _line(item)
        if "type" in m:
            type_text = self.scalar(m["type"][1], "'type'", node_id)
            type_line = _line(m["type"][1])
        else:
            self.error(item, "node has no 'type'", node_id)
        ok = type_text is not None
        raw: dict[str, str] = {}
        lines: dict[str, int] = {}
        if "config" in m:
            cfg = self.mapping(m["config"][1], "'config'", node_id)
            ok = ok and cfg is not None
            for key, (_, vn) in (cfg or {}).items():
                value = self.scalar(vn, f"config {key!r}", node_id)
                if value is None:
                    ok = False
                else:
                    key = intern(key)
                    raw[key], lines[key] = value, _line(vn)
        shapes: dict[str, Shapes | None] = {}
        for key in ("input_shapes", "output_shapes"):
            if key in m:
                shapes[key] = self.shapes(m[key][1], f"'{key}'", node_id)
                ok = ok and shapes[key] is not None
        return NodeRec(node_id, _line(item), type_text, type_line, raw, lines, None,
                       shapes.get("input_shapes"), shapes.get("output_shapes"), ok)

    def edge(self, item: yaml.Node) -> EdgeRec | None:
        m = self.mapping(item, "an edge")
        if m is None:
            return None
        for key, (kn, _) in m.items():
            if key not in EDGE_KEYS:
                self.error(kn, f"unknown edge key {key!r}{suggest(key, EDGE_KEYS)}")
        ends = {}
        for key in ("from", "to"):
            if key not in m:
                self.error(item, f"edge has no '{key}'")
                return None
            ends[key] = self.scalar(m[key][1], f"edge '{key}'")
        slots = {k: (self.integer(m[k][1], f"edge '{k}'", ends.get("to")) if k in m else 0)
                 for k in ("from_slot", "to_slot")}
        if None in ends.values() or None in slots.values():
            return None
        return EdgeRec(ends["from"], _line(m["from"][1]), ends["to"], _line(m["to"][1]),  # type: ignore
                       slots["from_slot"], slots["to_slot"], _line(item))  # type: ignore[arg-type]

    def endpoint(self, item: yaml.Node, kind: str) -> EndpointRec | None:
        m = self.mapping(item, f"an entry of '{kind}'")
        if m is None:
            return None
        allowed = ("name", "node_id", "slot_id") + (("type",) if kind == "metrics" else ())
        for key, (kn, _) in m.items():
            if key not in allowed:
                self.error(kn, f"unknown key {key!r} in '{kind}'{suggest(key, allowed)}")
        fields = {}
        for key in ("name", "node_id"):
            if key not in m:
                self.error(item, f"entry of '{kind}' has no '{key}'")
                return None
            fields[key] = self.scalar(m[key][1], f"'{key}'")
        slot = self.integer(m["slot_id"][1], "'slot_id'", fields["node_id"]) if "slot_id" in m else 0
        mtype = self.scalar(m["type"][1], "'type'") if "type" in m else None
        if None in fields.values() or slot is None:
            return None
        return EndpointRec(kind, fields["name"], fields["node_id"], slot, mtype,  # type: ignore[arg-type]
                           _line(item))


class _TooLarge(Exception):
    pass


def _read_yaml(text: str, build: _Builder) -> None:
    """The general reader: anything YAML, every structural problem reported."""
    file, sink = build.file, build.sink
    try:
        root = yaml.compose(text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        sink.error(f"YAML syntax error: {exc.problem or exc.context}", SourceLoc(file, line))
        build.readable = False
        return
    except (yaml.YAMLError, ValueError, RecursionError) as exc:
        # libyaml reports some encoding problems as plain ValueErrors.
        sink.error(f"YAML error: {exc}", SourceLoc(file, 1))
        build.readable = False
        return
    if root is None:
        sink.error("empty file: expected a network mapping with 'nodes' and 'edges'", SourceLoc(file, 1))
        build.readable = False
        return
    _YamlReader(build).read(root)


# -- the fast reader: the canonical layout `dumps` writes ----------------------------------
#
# Every character of the text must be consumed by one of the patterns below,
# and each pattern admits only what PyYAML reads the same way: plain scalars
# from a safe ASCII alphabet, double-quoted scalars without escapes or
# characters YAML treats specially (non-printables, line breaks, BOM), slots
# of at most 18 digits, short mapping keys (YAML caps implicit keys at 1024
# characters).  On anything else the general reader runs instead.

_PLAIN_TEXT = r"[A-Za-z_][A-Za-z0-9_.\-/]*"
_QUOTED_TEXT = r'"[^"\\\x00-\x1f\x7f-\x9f\u2028\u2029\ufeff\ud800-\udfff\ufffe\uffff]*"'
_SCALAR = f"(?:{_PLAIN_TEXT}|{_QUOTED_TEXT})"
_KEY = (r'(?:[A-Za-z_][A-Za-z0-9_.\-/]{0,500}'
        r'|"[^"\\\x00-\x1f\x7f-\x9f\u2028\u2029\ufeff\ud800-\udfff\ufffe\uffff]{0,500}")')
_DIMS = r"\[(?:[1-9][0-9]{0,17}(?:, [1-9][0-9]{0,17})*)?\]"
_SHAPES = rf"\[(?:{_DIMS}(?:, {_DIMS})*)?\]"
_SLOT = r"[0-9]{1,18}"

_TOP_NAME = re.compile(rf"name: ({_SCALAR})\n")
_TOP_PRECISION = re.compile(rf"(precision|param_precision|activation_precision): ({_SCALAR})\n")
_SECTION = re.compile(r"(nodes|edges|outputs|costs|metrics):( \[\])?\n")
_NODE = re.compile(
    rf"  - id: ({_SCALAR})\n"
    rf"    type: ({_SCALAR})\n"
    rf"(?:    config:\n((?:      {_KEY}: {_QUOTED_TEXT}\n)+))?"
    rf"(?:    input_shapes: ({_SHAPES})\n)?"
    rf"(?:    output_shapes: ({_SHAPES})\n)?")
_CONFIG_ITEM = re.compile(rf"      ({_KEY}): ({_QUOTED_TEXT})\n")
_EDGE = re.compile(rf"  - \{{from: ({_SCALAR}), to: ({_SCALAR})"
                   rf"(?:, from_slot: ({_SLOT}))?(?:, to_slot: ({_SLOT}))?\}}\n")
_ENDPOINT = re.compile(rf"  - \{{name: ({_SCALAR}), node_id: ({_SCALAR}), slot_id: ({_SLOT})"
                       rf"(?:, type: ({_SCALAR}))?\}}\n")
_DIM_LIST = re.compile(r"\[([0-9, ]*)\]")
_CONFIG_MEMO_SIZE = 64


class _NotCanonical(Exception):
    """The text leaves the canonical layout: use the general reader."""


def _text(token: str) -> str:
    if token[0] == '"':
        return token[1:-1]
    if token in _NULLS:  # a plain `null` is YAML's null, not the text "null"
        raise _NotCanonical
    return token


def _shapes_of(token: str | None) -> Shapes | None:
    if token is None:
        return None
    return tuple(tuple(int(d) for d in dims.split(", ")) if dims else ()
                 for dims in _DIM_LIST.findall(token[1:-1]))


def _read_fast(text: str, build: _Builder) -> bool:
    """Feed `build` from a text in `dumps`' layout; False (having fed it only part of the
    document: discard it) when the text is laid out any other way.

    For every text it accepts, `build` receives exactly what the general reader gives it.
    Records are handed over one at a time, so they never pile up in memory.
    """
    if not isinstance(text, str):
        return False
    if not text.endswith("\n"):
        text += "\n"
    try:
        _scan(text, build)
    except _NotCanonical:
        return False
    return True


def _scan(text: str, build: _Builder) -> None:
    m = _TOP_NAME.match(text)
    if m is None:
        raise _NotCanonical
    name = _text(m.group(1))
    pos, line = m.end(), 2
    attrs = []
    for key in PRECISION_KEYS:
        m = _TOP_PRECISION.match(text, pos)
        if m is not None and m.group(1) == key:
            attrs.append((key, _text(m.group(2)), line))
            pos, line = m.end(), line + 1
    build.name(name)
    for key, value, at in attrs:
        build.attr(key, value, at)
    for section in ("nodes", "edges", *ENDPOINT_KINDS):
        m = _SECTION.match(text, pos)
        if m is None or m.group(1) != section:
            if section in ("nodes", "edges"):
                raise _NotCanonical
            continue
        pos, line = m.end(), line + 1
        if m.group(2):  # "[]"
            continue
        if section == "nodes":
            pos, line = _scan_nodes(text, pos, line, build)
        elif section == "edges":
            pos, line = _scan_edges(text, pos, line, build)
        else:
            pos, line = _scan_endpoints(text, pos, line, section, build)
    if pos != len(text):
        raise _NotCanonical


def _scan_nodes(text: str, pos: int, line: int, build: _Builder) -> tuple[int, int]:
    match = _NODE.match
    # config text -> (config, its line count, the builder's memo); the last few only:
    # nodes with equal configs come close together, and a table that stays small stays in cache
    configs: dict[str, tuple[dict[str, str], int, dict[str, ParsedConfig]]] = {}
    empty: dict[str, str] = {}
    empty_memo: dict[str, ParsedConfig] = {}
    node = build.node
    while True:
        m = match(text, pos)
        if m is None:
            return pos, line
        node_id, type_token, block, ins, outs = m.groups()
        raw, memo = empty, empty_memo
        if block is not None:
            try:
                raw, count, memo = configs[block]
            except KeyError:
                items = _CONFIG_ITEM.findall(block)
                raw = {intern(_text(k) if k[0] == '"' else k): v[1:-1] for k, v in items}
                count, memo = len(items), {}
                if len(raw) != count:  # a duplicate key: reported by the general reader
                    raise _NotCanonical
                if len(configs) >= _CONFIG_MEMO_SIZE:
                    del configs[next(iter(configs))]
                configs[block] = raw, count, memo
            span = 3 + count
        else:
            span = 2
        in_shapes, out_shapes = _shapes_of(ins), _shapes_of(outs)
        span += (ins is not None) + (outs is not None)
        node(NodeRec(_text(node_id), line, _text(type_token), line + 1, raw, line + 3, memo,
                     in_shapes, out_shapes, True))
        pos, line = m.end(), line + span


def _scan_edges(text: str, pos: int, line: int, build: _Builder) -> tuple[int, int]:
    match = _EDGE.match
    edge = build.edge
    while True:
        m = match(text, pos)
        if m is None:
            return pos, line
        src, dst, src_slot, dst_slot = m.groups()
        edge(EdgeRec(_text(src), line, _text(dst), line, int(src_slot) if src_slot else 0,
                     int(dst_slot) if dst_slot else 0, line))
        pos, line = m.end(), line + 1


def _scan_endpoints(text: str, pos: int, line: int, kind: str, build: _Builder) -> tuple[int, int]:
    while True:
        m = _ENDPOINT.match(text, pos)
        if m is None:
            return pos, line
        name, node, slot, mtype = m.groups()
        if mtype is not None and kind != "metrics":  # an unknown key there: reported by the general reader
            raise _NotCanonical
        build.endpoint(EndpointRec(kind, _text(name), _text(node), int(slot),
                                   None if mtype is None else _text(mtype), line))
        pos, line = m.end(), line + 1


# -- loading -----------------------------------------------------------------------------

def loads(text: str, file: str = "<string>", *, validate: bool = True,
          warnings: list[Diagnostic] | None = None) -> Graph:
    """Parse network YAML text; raise VGraphError listing every problem.

    With `validate` (the default) the graph is also verified and its types
    inferred.  Warnings (e.g. unknown top-level keys) go into `warnings`.
    """
    return _loads(text, file, validate=validate, warnings=warnings)


def _loads(text: str, file: str, *, validate: bool = True, warnings: list[Diagnostic] | None = None,
           fast: bool | None = None) -> Graph:
    """`loads`, choosing the reader: None tries the fast one first, False never, True only it.

    `fast=True` raises LookupError when the text is not in the canonical
    layout (tests use it to compare the readers).
    """
    from .verify import check

    with paused_gc():
        sink = DiagnosticSink()
        build = _Builder(file, sink)
        if fast is False or not _read_fast(text, build):
            if fast:
                raise LookupError("not in the canonical layout")
            sink = DiagnosticSink()
            build = _Builder(file, sink)
            _read_yaml(text, build)
        graph = build.graph if build.readable else None
        build._ends.clear()  # the builder's index is not needed any more: free it before checking
        if graph is not None and validate:
            check(graph, sink, skip=build.broken)
    sink.raise_if_errors()
    if warnings is not None:
        warnings.extend(d for d in sink.items if d.severity == "warning")
    assert graph is not None  # no graph means a reported error
    return graph


def load(path: str | Path, *, validate: bool = True,
         warnings: list[Diagnostic] | None = None) -> Graph:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise VGraphError([Diagnostic(f"cannot read file: {reason}", SourceLoc(str(path), 1))]) from None
    return loads(text, str(path), validate=validate, warnings=warnings)


# -- writing -------------------------------------------------------------------------

_PLAIN = re.compile(_PLAIN_TEXT)  # the fast reader's plain scalars, matched whole (fullmatch)
_RESERVED = {"true", "false", "yes", "no", "on", "off", "null", "y", "n"}
# Characters a YAML double-quoted scalar cannot hold literally: non-printables,
# YAML's extra line breaks (NEL, LS, PS), the BOM and lone surrogates.
_UNPRINTABLE = re.compile("[\x7f-\x9f\u2028\u2029\ufeff\ud800-\udfff\ufffe\uffff]")


def _s(text: str) -> str:
    """A YAML scalar for an identifier: plain when unambiguous, else double-quoted."""
    if _PLAIN.fullmatch(text) and text.lower() not in _RESERVED:
        return text
    return _q(text)


def _q(text: str) -> str:
    """A YAML double-quoted scalar (JSON's escapes are a subset of YAML's)."""
    out = json.dumps(text, ensure_ascii=False)
    return _UNPRINTABLE.sub(lambda m: f"\\u{ord(m.group()):04x}", out)


def _shapes(shapes: Iterable[tuple[int, ...]]) -> str:
    return "[" + ", ".join("[" + ", ".join(map(str, s)) + "]" for s in shapes) + "]"


def dumps(graph: Graph) -> str:
    """The network as spec-format YAML text."""
    out: list[str] = [f"name: {_s(graph.name)}"]
    for key in PRECISION_KEYS:
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
