"""What the format's keys are, and the records both readers hand the builder.

A reader turns text into these plain records (each value with the line it
came from) and nothing else, so the two readers can be compared record for
record and one builder serves both.
"""
from __future__ import annotations

from typing import Any, NamedTuple

NULLS = ("", "~", "null", "Null", "NULL")  # the plain scalars YAML reads as null
NETWORK_KEYS = ("name", "precision", "param_precision", "activation_precision",
                "nodes", "edges", "outputs", "costs", "metrics")
PRECISION_KEYS = ("precision", "param_precision", "activation_precision")
NODE_KEYS = ("id", "type", "config", "input_shapes", "output_shapes")
EDGE_KEYS = ("from", "to", "from_slot", "to_slot")

Shapes = tuple[tuple[int, ...], ...]
ParsedConfig = tuple[dict[str, Any], list[tuple[str, str]]]  # what Schema.parse returns


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
