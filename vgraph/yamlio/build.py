"""Records -> IR: the checks of meaning both readers share.

Unknown types (with a suggestion), bad config values (the op's schema),
duplicate ids, dangling edges and doubly fed input slots are reported here,
once for both readers, each at the line of the record it comes from.
"""
from __future__ import annotations

from vgraph.base.diagnostics import DiagnosticSink, SourceLoc
from vgraph.ir.graph import Edge, Endpoint, Graph, GraphError, VNode, slot_taken
from vgraph.ops import REGISTRY
from vgraph.ops.schema import ConfigError, Field, suggest
from vgraph.yamlio.records import EdgeRec, EndpointRec, NodeRec, ParsedConfig

_PRECISION_FIELD = Field("precision", "precision")
_SUGGEST_LIMIT = 2_000  # "did you mean" over more node ids than this costs more than it helps
_SUGGESTIONS = 100  # ... and so does making more than this many of them for one file


class Builder:
    """Records -> IR, with the checks of meaning both readers share."""

    def __init__(self, file: str, sink: DiagnosticSink) -> None:
        self.file = file
        self.sink = sink
        self.graph = Graph(source=file)
        self._loader = self.graph.loader()
        self.readable = True  # False: no network could be read at all (reported)
        self.broken: set[str] = set()
        # id -> the loader's handle of the node: one lookup per edge end finds all it needs
        self._ends: dict[str, tuple] = {}
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
            end = self._loader.add_node(node)
        except GraphError:
            first = graph.node(node_id).loc
            self.error(rec.line, f"duplicate node id (first defined at line {first.line})" if first
                       else "duplicate node id", node_id)
            return
        self._ends[node_id] = end
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
        # The nodes' own id strings: the text's copies are dropped, and every later
        # lookup by an edge's end finds its key by identity.
        src, dst = src_end[0].id, dst_end[0].id  # type: ignore[index]
        busy = self._loader.add_edge(Edge(src, rec.src_slot, dst, rec.dst_slot, SourceLoc(self.file, rec.line)),
                                     src_end, dst_end)  # type: ignore[arg-type]
        if busy is not None:
            self.error(rec.line, slot_taken(busy), dst)

    def _suggest_id(self, word: str) -> str:
        graph = self.graph
        if len(graph) > _SUGGEST_LIMIT or self._suggestions_left <= 0:
            return ""
        self._suggestions_left -= 1
        return suggest(word, list(graph.node_ids()))

    def endpoint(self, rec: EndpointRec) -> None:
        self._loader.add_endpoint(rec.kind, Endpoint(rec.name, rec.node, rec.slot, rec.type,
                                                     SourceLoc(self.file, rec.line)))


def _config_line(rec: NodeRec, key: str) -> int:
    lines = rec.config_lines
    if isinstance(lines, int):
        return lines + list(rec.raw).index(key) if key in rec.raw else rec.line
    return lines.get(key, rec.line)
