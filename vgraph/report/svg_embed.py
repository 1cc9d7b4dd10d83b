"""Graphviz's SVG made safe to paste into an HTML page: parsed, reduced to drawing elements, written again.

Why: the drawing carries node ids, group and network names from files that
may be someone else's.  Graphviz escapes them as XML text, but an HTML page
parses inline SVG with its own rules, and a comment, a processing instruction,
a link or an event attribute would be live there.  Rather than trust every
path through Graphviz, the SVG is parsed as XML and rebuilt from an allowlist
of drawing elements and presentation attributes; anything else is dropped,
and the serializer escapes all text and attribute values again.
"""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from vgraph.base.diagnostics import VGraphError

__all__ = ["embeddable_svg"]

SVG_NS = "http://www.w3.org/2000/svg"
ALLOWED_TAGS = {"svg", "g", "title", "polygon", "polyline", "path", "ellipse", "circle", "rect", "line", "text",
                "tspan", "defs"}
ALLOWED_ATTRS = {"id", "class", "width", "height", "viewBox", "transform", "points", "d", "x", "y", "x1", "y1",
                 "x2", "y2", "cx", "cy", "r", "rx", "ry", "fill", "fill-opacity", "stroke", "stroke-width",
                 "stroke-dasharray", "stroke-opacity", "font-family", "font-size", "font-weight", "font-style",
                 "text-anchor", "preserveAspectRatio", "opacity"}
_UNSAFE_VALUE = re.compile(r"url\s*\(|javascript:|expression\s*\(|[<>]", re.IGNORECASE)


def _local(name: str) -> str:
    return name.rsplit("}", 1)[-1]


def embeddable_svg(svg_text: str, *, css_class: str = "network") -> str:
    """`svg_text` (an SVG document) as one `<svg>` element holding only drawing elements, at its own size.

    Its own size (Graphviz's width and height in points) and not the page's
    width: a drawing shrunk to fit a page made a 10 pt label about 7 px tall
    on a 1,400 px wide screen; unshrunk, node labels are 13.3 CSS px and edge
    labels 12 px, and the page scrolls the drawing instead (report/page.py).
    """
    try:
        root = ET.fromstring(svg_text.encode("utf-8"))
    except ET.ParseError as exc:
        raise VGraphError(f"the network drawing is not well-formed SVG ({exc})") from None
    if _local(root.tag) != "svg":
        raise VGraphError("the network drawing is not an SVG document")
    clean = _copy(root)
    if clean is None:  # pragma: no cover - the root is an allowed tag
        raise VGraphError("the network drawing is empty")
    clean.set("class", css_class)
    width, height = clean.attrib.get("width"), clean.attrib.get("height")
    if "viewBox" not in clean.attrib and width and height:
        clean.set("viewBox", f"0 0 {_number(width)} {_number(height)}")
    clean.set("preserveAspectRatio", "xMidYMin meet")
    ET.register_namespace("", SVG_NS)
    return ET.tostring(clean, encoding="unicode", short_empty_elements=True)


def _number(text: str) -> str:
    match = re.match(r"\s*([0-9.]+)", text)
    return match.group(1) if match else "0"


def _copy(element: ET.Element) -> ET.Element | None:
    tag = _local(element.tag)
    if tag not in ALLOWED_TAGS or (element.tag.startswith("{") and not element.tag.startswith("{" + SVG_NS)):
        return None
    out = ET.Element(f"{{{SVG_NS}}}{tag}")
    for name, value in element.attrib.items():
        local = _local(name)
        if name.startswith("{") or local not in ALLOWED_ATTRS or _UNSAFE_VALUE.search(value):
            continue
        out.set(local, value)
    out.text = element.text
    for child in element:
        kept = _copy(child)
        if kept is not None:
            out.append(kept)
            kept.tail = child.tail
        else:
            # Graphviz wraps a node with a tooltip in <a>: keep what it draws, drop the link itself.
            inner = [_copy(grandchild) for grandchild in child] if _local(child.tag) in ("a", "switch") else []
            out.extend(k for k in inner if k is not None)
    return out
