"""The general reader: any YAML text, composed by PyYAML, walked into records.

PyYAML only *composes* the text (no Python object is constructed, so no tag
can run code; tags outside YAML's core schema are refused) and scalars are
read as their text, so `512` and `"512"` are the same config value.  Every
structural problem is reported with its line.  The fleet reader
(`vgraph.cost.fleet`) walks its documents with the same `YamlReader`.
"""
from __future__ import annotations

from sys import intern
from typing import Any

import yaml

from vgraph.base.diagnostics import SourceLoc, quote
from vgraph.ir.graph import ENDPOINT_KINDS
from vgraph.ops.schema import ConfigError, _parse_int, suggest
from vgraph.yamlio.build import Builder
from vgraph.yamlio.records import (EDGE_KEYS, NETWORK_KEYS, NODE_KEYS, NULLS, PRECISION_KEYS, EdgeRec, EndpointRec,
                                   NodeRec, Shapes)

# The base loader resolves no implicit types: every plain scalar arrives as text
# (what we want: config values are strings), and composing is several times
# faster than with the safe loader's resolver.  Explicit tags are still seen.
Loader = getattr(yaml, "CBaseLoader", yaml.BaseLoader)
_STD = "tag:yaml.org,2002:"
_SAFE_TAGS = {_STD + t for t in ("str", "int", "float", "bool", "null", "map", "seq", "timestamp")}
_MAX_PLAIN_NODES = 1_000_000  # uninterpreted top-level values: more YAML nodes than this is an alias bomb
# Aliases may repeat at most this many YAML nodes in a whole document beyond what it spells out (or as many as
# it spells out, if more): sharing a config block is fine, a few lines standing for millions of nodes is not.
MAX_ALIAS_EXPANSION = 100_000
# Collections inside collections: libyaml refuses deeper ones from PyYAML 6.0.4 on; with 6.0.3 (which
# `pyyaml>=6.0` admits) the C composer recursed until the stack ran out: 20,000 levels of `[` loaded, 200,000
# killed the process with SIGSEGV, and so did 200,000 of `- ` on one line (400 kB).  `compose` refuses them itself, whatever the PyYAML.
MAX_NESTING = 1000


def compose(text: str, loader: type = Loader) -> "yaml.Node | None":
    """yaml.compose, but nesting deeper than MAX_NESTING is a yaml.MarkedYAMLError at the level that is too
    deep, never a crash.  Levels are counted on the parser's events (an iteration, no recursion: 6 ms for the
    12-layer network, whose compose takes 17 ms) only when the text could hold that many: each level opens
    with a `[`, a `{`, a `- `, a `? ` or a new line (`- - - 1` nests three sequences on one line)."""
    bound = sum(text.count(c) for c in "[{-?\n\r\x85\u2028\u2029")  # \r, NEL, LS and PS break lines too
    if bound > MAX_NESTING:
        depth = 0
        for event in yaml.parse(text, Loader=loader):
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_NESTING:
                    raise yaml.MarkedYAMLError(problem=f"collections nested deeper than {MAX_NESTING} levels",
                                               problem_mark=event.start_mark)
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
    return yaml.compose(text, Loader=loader)


def _is_null(ynode: yaml.Node) -> bool:
    # The C composer gives plain scalars style '' and the Python one None.
    return ynode.tag == _STD + "null" or (
        isinstance(ynode, yaml.ScalarNode) and not ynode.style and ynode.value in NULLS)


def _kind(ynode: yaml.Node) -> str:
    if isinstance(ynode, yaml.MappingNode):
        return "a mapping"
    if isinstance(ynode, yaml.SequenceNode):
        return "a list"
    return quote(ynode.value)  # cut: a 5 MB scalar must not become a 5 MB message


def line_of(ynode: yaml.Node) -> int:
    return ynode.start_mark.line + 1


class YamlReader:
    """Walks composed YAML nodes, reporting structural problems with their line.

    Long because it is one walk over the network YAML's sections (nodes, edges, endpoints): each section's
    reader uses the shared typed readers (`mapping`, `scalar`, `integer`, `shapes`), which report a problem
    with the line of the YAML node they stand on.
    """

    def __init__(self, build: Builder) -> None:
        self.build = build
        self.sink = build.sink

    def error(self, ynode: yaml.Node, msg: str, node: str | None = None) -> None:
        self.build.error(line_of(ynode), msg, node)

    def safe(self, ynode: yaml.Node, node: str | None = None) -> bool:
        """Refuse any tag outside YAML's core schema (e.g. !!python/object)."""
        if ynode.tag not in _SAFE_TAGS:
            self.error(ynode, f"unsafe or unsupported YAML tag {quote(ynode.tag)}: only plain "
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
                self.error(k, f"duplicate key {quote(k.value)} in {what} (first at line "
                              f"{line_of(out[k.value][0])})", node)
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
            self.error(ynode, f"{what} must be an integer, got {quote(text)}", node)
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
                    build.attr(key, text, line_of(top[key][1]))
        for key, (kn, vn) in top.items():
            if key not in NETWORK_KEYS:
                self.sink.warning(f"unknown top-level key {quote(key)}{suggest(key, NETWORK_KEYS)}: "
                                  f"kept as is, not interpreted", build.loc(line_of(kn)))
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
                self.error(kn, f"unknown node key {quote(key)}{suggest(key, NODE_KEYS)}", node_id)
        type_text, type_line = None, line_of(item)
        if "type" in m:
            type_text = self.scalar(m["type"][1], "'type'", node_id)
            type_line = line_of(m["type"][1])
        else:
            self.error(item, "node has no 'type'", node_id)
        ok = type_text is not None
        raw: dict[str, str] = {}
        lines: dict[str, int] = {}
        if "config" in m:
            cfg = self.mapping(m["config"][1], "'config'", node_id)
            ok = ok and cfg is not None
            for key, (_, vn) in (cfg or {}).items():
                value = self.scalar(vn, f"config {quote(key)}", node_id)
                if value is None:
                    ok = False
                else:
                    key = intern(key)
                    raw[key], lines[key] = value, line_of(vn)
        shapes: dict[str, Shapes | None] = {}
        for key in ("input_shapes", "output_shapes"):
            if key in m:
                shapes[key] = self.shapes(m[key][1], f"'{key}'", node_id)
                ok = ok and shapes[key] is not None
        return NodeRec(node_id, line_of(item), type_text, type_line, raw, lines, None,
                       shapes.get("input_shapes"), shapes.get("output_shapes"), ok)

    def edge(self, item: yaml.Node) -> EdgeRec | None:
        m = self.mapping(item, "an edge")
        if m is None:
            return None
        for key, (kn, _) in m.items():
            if key not in EDGE_KEYS:
                self.error(kn, f"unknown edge key {quote(key)}{suggest(key, EDGE_KEYS)}")
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
        return EdgeRec(ends["from"], line_of(m["from"][1]), ends["to"], line_of(m["to"][1]),  # type: ignore
                       slots["from_slot"], slots["to_slot"], line_of(item))  # type: ignore[arg-type]

    def endpoint(self, item: yaml.Node, kind: str) -> EndpointRec | None:
        m = self.mapping(item, f"an entry of '{kind}'")
        if m is None:
            return None
        allowed = ("name", "node_id", "slot_id") + (("type",) if kind == "metrics" else ())
        for key, (kn, _) in m.items():
            if key not in allowed:
                self.error(kn, f"unknown key {quote(key)} in '{kind}'{suggest(key, allowed)}")
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
                           line_of(item))


class _TooLarge(Exception):
    pass


def read_yaml(text: str, build: Builder) -> None:
    """The general reader: anything YAML, every structural problem reported."""
    file, sink = build.file, build.sink
    try:
        root = compose(text)
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
    problem = alias_expansion_problem(root)
    if problem is not None:
        sink.error(problem, SourceLoc(file, 1))
        build.readable = False
        return
    YamlReader(build).read(root)


def alias_expansion_problem(root: yaml.Node, limit: int = MAX_ALIAS_EXPANSION) -> str | None:
    """Why the composed document is an alias bomb, or None.

    The composer shares an aliased node instead of copying it, so the document
    is a DAG; its size with every alias expanded is counted in one pass over
    the distinct nodes (sizes memoised), before anything walks it.  The whole
    document is bounded, not each value: 300 keys naming one anchor are 300
    expansions.
    """
    size: dict[int, int] = {}
    distinct = 0
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        yn, children_done = stack.pop()
        key = id(yn)
        if key in size and not children_done:
            continue
        if isinstance(yn, yaml.ScalarNode):
            size[key] = 1
            distinct += 1
            continue
        kids = [c for kv in yn.value for c in kv] if isinstance(yn, yaml.MappingNode) else list(yn.value)
        if children_done:
            size[key] = 1 + sum(size.get(id(c), 0) for c in kids)
            distinct += 1
            continue
        size[key] = 0  # in progress: an alias to an ancestor (a recursive anchor) counts as nothing more
        stack.append((yn, True))
        stack.extend((c, False) for c in kids if id(c) not in size)
    expanded = size[id(root)]
    allowed = distinct + max(limit, distinct)
    if expanded > allowed:
        return (f"the document's aliases expand it to {expanded:,} YAML nodes from {distinct:,} written "
                f"(at most {allowed:,}): an alias bomb, refused")
    return None
