"""The fast reader: the canonical layout that `dumps` writes, scanned with regular expressions.

Composing a 100k-VNode file with PyYAML alone takes seconds; the canonical
layout is what vgraph and the generators write, so it is what large files look
like.  This reader recognises exactly that layout and gives up (returns False)
on anything else, in which case the general reader runs.  For every text it
accepts it hands the builder exactly what the general reader would
(tests/test_properties.py checks it on valid and mutated texts).
"""
from __future__ import annotations

import re
from sys import intern

from vgraph.ir.graph import ENDPOINT_KINDS
from vgraph.yamlio.build import Builder
from vgraph.yamlio.records import NULLS, PRECISION_KEYS, EdgeRec, EndpointRec, NodeRec, ParsedConfig, Shapes

# Every character of the text must be consumed by one of the patterns below,
# and each pattern admits only what PyYAML reads the same way: plain scalars
# from a safe ASCII alphabet, double-quoted scalars without escapes or
# characters YAML treats specially (non-printables, line breaks, BOM), slots
# of at most 18 digits, short mapping keys (YAML caps implicit keys at 1024
# characters).  On anything else the general reader runs instead.

PLAIN_TEXT = r"[A-Za-z_][A-Za-z0-9_.\-/]*"
_QUOTED_TEXT = r'"[^"\\\x00-\x1f\x7f-\x9f\u2028\u2029\ufeff\ud800-\udfff\ufffe\uffff]*"'
_SCALAR = f"(?:{PLAIN_TEXT}|{_QUOTED_TEXT})"
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
    if token in NULLS:  # a plain `null` is YAML's null, not the text "null"
        raise _NotCanonical
    return token


def _shapes_of(token: str | None) -> Shapes | None:
    if token is None:
        return None
    return tuple(tuple(int(d) for d in dims.split(", ")) if dims else ()
                 for dims in _DIM_LIST.findall(token[1:-1]))


def read_fast(text: str, build: Builder) -> bool:
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


def _scan(text: str, build: Builder) -> None:
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


def _scan_nodes(text: str, pos: int, line: int, build: Builder) -> tuple[int, int]:
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


def _scan_edges(text: str, pos: int, line: int, build: Builder) -> tuple[int, int]:
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


def _scan_endpoints(text: str, pos: int, line: int, kind: str, build: Builder) -> tuple[int, int]:
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
