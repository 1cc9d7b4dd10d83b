"""`vgraph passes [--json]`: every pass, what it does, its options, and where it runs in a pipeline.

A user writing a pipeline needs each option's type, default and allowed
values, and the ordering a pass declares (`requires`, `after`, `before`):
the pass manager reorders the written pipeline by them, so they are shown
here rather than discovered by surprise.
"""
from __future__ import annotations

import json
from typing import Any

from vgraph.transform.pass_api import Option, Pass
from vgraph.transform.pipeline import DEFAULT_PIPELINE, PassInfo, available_passes

_JSON_SCALARS = (str, int, float, bool, type(None))


def _plain(value: Any) -> Any:
    """A default as JSON can carry it (anything else as its text)."""
    return value if isinstance(value, _JSON_SCALARS) else str(value)


def option_json(key: str, opt: Option) -> dict[str, Any]:
    out: dict[str, Any] = {"name": key, "type": opt.type_name, "default": _plain(opt.default), "doc": opt.doc}
    if opt.choices is not None:
        out["choices"] = [_plain(c) for c in opt.choices]
    if opt.min is not None:
        out["min"] = opt.min
    if opt.max is not None:
        out["max"] = opt.max
    return out


def pass_json(info: PassInfo, cls: type[Pass]) -> dict[str, Any]:
    out = {"name": info.name, "doc": cls.doc(), "origin": info.origin,
           "preserves_semantics": bool(cls.preserves_semantics),
           "requires": list(cls.requires), "after": list(cls.after), "before": list(getattr(cls, "before", ())),
           "invalidates": list(cls.invalidates),
           "options": [option_json(k, o) for k, o in cls.options.items()]}
    if getattr(info, "overrides", ""):
        out["overrides"] = info.overrides
    return out


def listing() -> dict[str, Any]:
    """Every available pass as one JSON document (imports each pass's module, as running it would)."""
    return {"default_pipeline": str(DEFAULT_PIPELINE),
            "passes": [pass_json(info, info.load()) for info in available_passes().values()]}


def format_listing(doc: dict[str, Any]) -> str:
    lines: list[str] = []
    for p in doc["passes"]:
        lines.append(f"{p['name']}  [{p['origin']}]")
        lines.append(f"    {p['doc']}")
        if "overrides" in p:
            lines.append(f"    replaces the built-in pass of this name ({p['overrides']})")
        lines.append("    keeps what the network computes" if p["preserves_semantics"] else
                     "    changes what the network computes (a run trained after it stores the new network)")
        order = [f"{label} {', '.join(p[key])}" for label, key in
                 (("requires", "requires"), ("runs after", "after"), ("runs before", "before")) if p[key]]
        if order:
            lines.append(f"    order: {'; '.join(order)} (when in the same pipeline)")
        if p["invalidates"]:
            lines.append(f"    invalidates {', '.join(p['invalidates'])}")
        for o in p["options"]:
            allowed = Option(choices=tuple(o["choices"]) if "choices" in o else None,
                             min=o.get("min"), max=o.get("max")).allowed()
            detail = ", ".join(filter(None, [o["type"], f"default {o['default']!r}", allowed]))
            lines.append(f"    option {o['name']} ({detail}){': ' + o['doc'] if o['doc'] else ''}")
    lines.append(f"default pipeline: {doc['default_pipeline']}")
    return "\n".join(lines)


def print_listing(as_json: bool) -> None:
    doc = listing()
    print(json.dumps(doc, indent=2) if as_json else format_listing(doc))
