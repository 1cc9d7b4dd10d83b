"""`vgraph ops [--json]`: every op type the IR knows, where it came from and which backends lower it.

Registered as a command through the `vgraph.commands` entry points like the
backends' commands, so the core CLI module stays small.  Which backends lower
an op is read from the `vgraph.lowerings.<backend>` entry point names (and
plugin files' `@lowering` declarations): listing ops never imports torch or
onnx.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from vgraph.ops import COMMON_FIELDS, REGISTRY, Field, OpDef
from vgraph.plugins import BUILTIN, declared_lowerings


def field_json(f: Field) -> dict[str, Any]:
    """One config key as data: type, required or default, allowed values, range, doc."""
    out: dict[str, Any] = {"name": f.name, "type": f.kind, "required": f.required}
    if f.default is not None:
        out["default"] = Field.format(f.default)
    if f.choices is not None:
        out["choices"] = list(f.choices)
    if f.min is not None:
        out["min"] = f.min
    if f.max is not None:
        out["max"] = f.max
    if f.doc:
        out["doc"] = f.doc
    return out


def origin_of(op: OpDef) -> str:
    return "built-in" if op.origin == BUILTIN else op.origin


def op_json(op: OpDef, lowered: dict[str, str]) -> dict[str, Any]:
    return {"name": op.name, "category": op.category, "doc": op.doc, "aliases": list(op.aliases),
            "config": [field_json(f) for f in op.schema.fields], "trainable": op.trainable,
            "origin": origin_of(op), "lowered_by": sorted(lowered)}


def listing() -> dict[str, Any]:
    """The whole catalog as one JSON document."""
    lowerings = declared_lowerings()
    return {"ops": [op_json(op, lowerings.get(op.name, {})) for op in REGISTRY],
            "common_config": [field_json(f) for f in COMMON_FIELDS]}


def describe_field(f: dict[str, Any]) -> str:
    parts = [f["type"], "required" if f["required"] else f"default {f.get('default', 'unset')}"]
    if "choices" in f:
        parts.append("one of " + "|".join(f["choices"]))
    if "min" in f:
        parts.append(f">= {f['min']:g}")
    if "max" in f:
        parts.append(f"<= {f['max']:g}")
    doc = f"  {f['doc']}" if "doc" in f else ""
    return f"{f['name']}: {', '.join(parts)}{doc}"


def format_listing(doc: dict[str, Any]) -> str:
    lines: list[str] = []
    for op in doc["ops"]:
        aliases = f"; aliases {', '.join(op['aliases'])}" if op["aliases"] else ""
        lowered = ", ".join(op["lowered_by"]) or "no backend"
        lines.append(f"{op['name']}  [{op['category']}; {op['origin']}{aliases}; lowered by {lowered}]")
        if op["doc"]:
            lines.append(f"    {op['doc']}")
        lines += [f"    {describe_field(f)}" for f in op["config"]]
    keys = ", ".join(f["name"] for f in doc["common_config"])
    lines.append(f"every op type also accepts: {keys} (see --json)")
    return "\n".join(lines)


def run_ops(args: argparse.Namespace) -> int:
    doc = listing()
    print(json.dumps(doc, indent=2) if args.json else format_listing(doc))
    return 0
