"""The report charts' legend sits in the top corner that hides fewer points (a falling loss curve's first
steps were under the fixed top-left legend)."""
from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from vgraph.report.charts import Series, line_chart

WIDTH = 560


def _legend_box(svg: str) -> tuple[float, float]:
    """x and width of the legend's background (the one rect drawn translucent)."""
    m = re.search(r'<rect x="([0-9.]+)" y="[0-9.]+" width="([0-9.]+)" height="[0-9.]+" fill="#ffffff" '
                  r'fill-opacity="0.85"/>', svg)
    assert m, svg
    return float(m.group(1)), float(m.group(2))


def test_a_falling_loss_curve_gets_the_legend_on_the_right() -> None:
    falling = [(s, 9.0 - 3.0 * s / 100) for s in range(1, 101)]
    x, width = _legend_box(line_chart("Loss", [Series("train loss", falling)]))
    assert x > WIDTH / 2 and x + width <= WIDTH


def test_a_rising_curve_keeps_the_legend_on_the_left() -> None:
    rising = [(s, float(s)) for s in range(1, 101)]
    x, _ = _legend_box(line_chart("Throughput", [Series("tokens/s", rising)]))
    assert x < WIDTH / 2


def test_a_flat_series_keeps_the_legend_on_the_left() -> None:
    x, _ = _legend_box(line_chart("lr", [Series("lr", [(s, 0.003) for s in range(1, 21)])]))
    assert x < WIDTH / 2  # hidden nowhere (the flat line is drawn mid-height): ties keep the usual corner


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10_000), st.floats(-1e6, 1e6, allow_nan=False)), min_size=1,
                max_size=60),
       st.text(min_size=1, max_size=80))
def test_the_legend_stays_inside_the_chart(points: list[tuple[int, float]], label: str) -> None:
    x, width = _legend_box(line_chart("t", [Series(label, [(float(a), b) for a, b in points])]))
    assert 0 <= x and (x + width <= WIDTH or x < WIDTH / 2)  # a legend wider than half the plot stays left
