"""Writing: the canonical layout, which the fast reader reads back.

Config values are written as quoted strings, shapes per sample, slots only
when not 0, identifiers plain when YAML reads them back unchanged and
double-quoted otherwise.  `save` writes atomically.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import yaml

from vgraph.ir.graph import ENDPOINT_KINDS, Graph
from vgraph.ops.schema import Field
from vgraph.yamlio.fast_reader import PLAIN_TEXT
from vgraph.yamlio.records import PRECISION_KEYS

_PLAIN = re.compile(PLAIN_TEXT)  # the fast reader's plain scalars, matched whole (fullmatch)
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
    """Write atomically (vgraph.base.safeio): a reader never sees a half-written network."""
    from vgraph.base.safeio import atomic_write

    atomic_write(path, dumps(graph))
