"""Line charts as inline SVG text, drawn here so a report needs no plotting library, script or network.

Why by hand: `vgraph report` is part of the core (no matplotlib, no torch)
and its page must open anywhere, offline, without running a script; an SVG
of polylines, axes and a legend is all a loss curve needs.  Every piece of
text that ends up in the markup (labels, series names from a network file)
is escaped, and only finite numbers are drawn.
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Sequence

from vgraph.base.diagnostics import printable

__all__ = ["Series", "line_chart", "PALETTE", "nice_ticks", "tick_labels", "format_number"]

# Distinct colours, in the order series get them (a test finds the curves by these colours).
PALETTE = ("#2563eb", "#ea580c", "#16a34a", "#9333ea", "#db2777", "#0891b2", "#ca8a04", "#4b5563")


@dataclass
class Series:
    label: str
    points: list[tuple[float, float]] = field(default_factory=list)
    color: str = PALETTE[0]
    markers: bool = False  # dots on the points (sparse series such as validation loss)


def _text(value: object) -> str:
    """Text for the markup: control characters written as escapes (`printable`), then HTML-escaped."""
    return html.escape(printable(value))


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def format_number(x: float) -> str:
    """Short, readable axis and table numbers: 4.56, 0.000612, 1.2k, 3.4M."""
    ax = abs(x)
    if ax >= 1e9:
        return f"{x / 1e9:.3g}G"
    if ax >= 1e6:
        return f"{x / 1e6:.3g}M"
    if ax >= 1e4:
        return f"{x / 1e3:.3g}k"
    return f"{x:.4g}"


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round values covering [lo, hi] (steps of 1, 2 or 5 x 10^k)."""
    if not (_finite(lo) and _finite(hi)) or hi < lo:
        return []
    if hi == lo:
        return [lo]
    raw = (hi - lo) / max(1, count)
    if not (math.isfinite(raw) and raw >= 1e-300 * max(1.0, abs(lo), abs(hi))):
        return [lo, hi]  # a span past float range (-1.7e308 to 1.7e308), or one float apart: no round steps
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks = []
    value = first
    while value <= hi + step * 1e-9 and len(ticks) < 50:
        ticks.append(0.0 if abs(value) < step * 1e-9 else value)
        value += step
    return ticks


def tick_labels(ticks: Sequence[float]) -> list[str]:
    """Labels for evenly spaced ticks with as many decimals as their spacing needs (4.5640, 4.5642, ...)."""
    if len(ticks) < 2 or max(abs(t) for t in ticks) >= 1e4:
        return [format_number(t) for t in ticks]
    step = abs(ticks[1] - ticks[0])
    decimals = min(10, max(0, math.ceil(-math.log10(step) - 1e-9))) if step > 0 else 4
    return [f"{t:.{decimals}f}" for t in ticks]


def _legend_x(drawn: Sequence[Series], px: Callable[[float], float], py: Callable[[float], float], left: float,
              plot_w: float, top: float, box_w: float, box_h: float) -> float:
    """The legend's x: the top corner (left or right) that hides fewer points.

    Why: a loss curve starts high on the left, which a fixed top-left legend covered (its first steps).
    """
    def hidden(x: float) -> int:
        return sum(1 for s in drawn for a, b in s.points
                   if x - 4 <= px(a) <= x - 4 + box_w and top + 2 <= py(b) <= top + 2 + box_h)

    left_x, right_x = left + 8, max(left + 8, left + plot_w - box_w - 4)
    return right_x if hidden(right_x) < hidden(left_x) else left_x


def line_chart(title: str, series: Sequence[Series], *, x_label: str = "step", y_label: str = "",
               width: int = 560, height: int = 280, css_class: str = "chart",
               y_format: Callable[[Sequence[float]], list[str]] = tick_labels) -> str:
    """An SVG element with one polyline per series, axes with round ticks and a legend."""
    e = _text
    drawn = [Series(s.label, [(float(x), float(y)) for x, y in s.points if _finite(x) and _finite(y)], s.color,
                    s.markers) for s in series]
    out = [f'<svg class="{e(css_class)}" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img"><title>{e(title)}</title>',
           f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
           f'<text x="{_Frame.left}" y="18" font-size="13" font-weight="600" fill="#0f172a">{e(title)}</text>']
    if not any(s.points for s in drawn):
        out.append(f'<text x="{width / 2:.0f}" y="{height / 2:.0f}" font-size="12" fill="#64748b" '
                   f'text-anchor="middle">no data yet</text></svg>')
        return "".join(out)
    frame = _Frame.around(drawn, width, height)
    out += _axes(frame, x_label, y_label, y_format)
    out += _curves(frame, drawn)
    out += _legend(frame, drawn)
    out.append("</svg>")
    return "".join(out)


@dataclass(frozen=True)
class _Frame:
    """Where the plot area sits in the chart and which data ranges its edges stand for."""

    width: int
    height: int
    x0: float
    x1: float
    y0: float
    y1: float
    left: ClassVar[int] = 76
    right: ClassVar[int] = 16
    top: ClassVar[int] = 30
    bottom: ClassVar[int] = 46

    @classmethod
    def around(cls, drawn: Sequence[Series], width: int, height: int) -> "_Frame":
        """The frame that shows every point: x from the first to the last, y padded by 6% (5% of the value,
        or 1, for a flat series)."""
        xs = [x for s in drawn for x, _ in s.points]
        ys = [y for s in drawn for _, y in s.points]
        x0, x1 = min(xs), max(xs)
        y0, y1 = min(ys), max(ys)
        if x1 == x0:
            x0, x1 = x0 - 1, x1 + 1
        pad = (abs(y0) * 0.05 or 1.0) if y1 == y0 else (y1 - y0) * 0.06
        return cls(width, height, x0, x1, y0 - pad, y1 + pad)

    @property
    def plot_w(self) -> int:
        return self.width - self.left - self.right

    @property
    def plot_h(self) -> int:
        return self.height - self.top - self.bottom

    def px(self, x: float) -> float:
        return self.left + (x - self.x0) / (self.x1 - self.x0) * self.plot_w

    def py(self, y: float) -> float:
        return self.top + (1 - (y - self.y0) / (self.y1 - self.y0)) * self.plot_h


def _axes(f: _Frame, x_label: str, y_label: str, y_format: Callable[[Sequence[float]], list[str]]) -> list[str]:
    """The plot's border, horizontal grid lines with y labels, x ticks, and the axis titles."""
    e, left, top, plot_w, plot_h = _text, f.left, f.top, f.plot_w, f.plot_h
    out = [f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#cbd5e1"/>']
    y_ticks = nice_ticks(f.y0, f.y1)
    for t, label in zip(y_ticks, y_format(y_ticks)):
        y = f.py(t)
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e2e8f0"/>'
                   f'<text x="{left - 6}" y="{y + 4:.1f}" font-size="10" fill="#475569" text-anchor="end">'
                   f'{e(label)}</text>')
    x_ticks = [t for t in nice_ticks(f.x0, f.x1, 6) if float(t).is_integer()] or nice_ticks(f.x0, f.x1, 6)
    for t in x_ticks:
        x = f.px(t)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top + plot_h}" y2="{top + plot_h + 4}" stroke="#94a3b8"/>'
                   f'<text x="{x:.1f}" y="{top + plot_h + 16}" font-size="10" fill="#475569" text-anchor="middle">'
                   f'{e(format_number(t))}</text>')
    out.append(f'<text x="{left + plot_w / 2:.0f}" y="{f.height - 8}" font-size="11" fill="#334155" '
               f'text-anchor="middle">{e(x_label)}</text>')
    if y_label:
        out.append(f'<text x="12" y="{top + plot_h / 2:.0f}" font-size="11" fill="#334155" text-anchor="middle" '
                   f'transform="rotate(-90 12 {top + plot_h / 2:.0f})">{e(y_label)}</text>')
    return out


def _curves(f: _Frame, drawn: Sequence[Series]) -> list[str]:
    """One polyline per series (its label as the tooltip), dots where asked or for a single point."""
    out = []
    for s in drawn:
        if not s.points:
            continue
        path = " ".join(f"{f.px(x):.1f},{f.py(y):.1f}" for x, y in s.points)
        color = _text(s.color)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2.2" '
                   f'stroke-linejoin="round"><title>{_text(s.label)}</title></polyline>')
        if s.markers or len(s.points) == 1:
            out += [f'<circle cx="{f.px(x):.1f}" cy="{f.py(y):.1f}" r="3.5" fill="{color}"/>' for x, y in s.points]
    return out


def _legend(f: _Frame, drawn: Sequence[Series]) -> list[str]:
    """A legend box in the top corner that hides fewer points (`_legend_x`)."""
    widest = max(len(s.label[:60]) for s in drawn)
    box_w, box_h = 30 + 6.2 * widest, 15 * len(drawn) + 4
    legend_x = _legend_x(drawn, f.px, f.py, f.left, f.plot_w, f.top, box_w, box_h)
    out = [f'<rect x="{legend_x - 4}" y="{f.top + 2}" width="{box_w:.0f}" height="{box_h}" '
           f'fill="#ffffff" fill-opacity="0.85"/>']
    for i, s in enumerate(drawn):
        y = f.top + 14 + 15 * i
        out.append(f'<rect x="{legend_x}" y="{y - 8}" width="14" height="4" fill="{_text(s.color)}"/>'
                   f'<text x="{legend_x + 20}" y="{y - 3}" font-size="11" fill="#1e293b">{_text(s.label[:60])}</text>')
    return out
