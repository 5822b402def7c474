"""The geometry of the pages' SVG charts: numbers here, markup in
``templates/charts.html``.

Two kinds: one horizontal bar split by counts (the machines per state),
and stacked columns, one per bucket (work outcomes per hour). Colours are
fixed per series name (`COLOURS`), so that charts read alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: Colours of the chart series (by name), fixed so charts read alike.
COLOURS = {
    "Finished": "#2a7",
    "Failed": "#c33",
    "Canceled": "#999",
    "failed": "#c33",
    "unprovided": "#bbb",
    "needs-agent-start": "#e90",
    "started": "#59d",
    "heartbeating": "#2a7",
    "silent": "#737",
    "decommissioned": "#555",
}
#: A series without a colour of its own.
OTHER = "#555"


@dataclass(frozen=True)
class Rect:
    """One coloured rectangle, with its tooltip; in pixels, to a tenth."""

    x: float
    y: float
    width: float
    height: float
    colour: str
    title: str


@dataclass(frozen=True)
class Chart:
    """An SVG of ``width`` x ``height`` with ``rects``; a legend of
    (colour, series, total) below it, and the peak of a column chart."""

    width: int
    height: int
    rects: list[Rect]
    legend: list[tuple[str, str, int]]
    peak: int | None = None


def _rect(x: float, y: float, width: float, height: float, colour: str, title: str) -> Rect:
    return Rect(round(x, 1), round(y, 1), round(width, 1), round(height, 1), colour, title)


def stacked_bar(counts: Sequence[tuple[str, int]], *, width: int = 600) -> Chart:
    """One bar ``width`` wide split by ``counts`` (name, count)."""
    total = sum(c for _, c in counts) or 1
    x = 0.0
    rects = []
    for name, count in counts:
        w = width * count / total
        rects.append(_rect(x, 0, w, 14, COLOURS.get(name, OTHER), f"{name}: {count}"))
        x += w
    legend = [(COLOURS.get(n, OTHER), n, c) for n, c in counts]
    return Chart(width, 14, rects, legend)


def columns(
    buckets: Sequence[str], series: Mapping[str, Sequence[int]], *, height: int = 80
) -> Chart:
    """Stacked columns, one per bucket (e.g. hour), one colour per series
    (``series[name][i]``: the series' value in bucket i)."""
    peak = max((sum(v[i] for v in series.values()) for i in range(len(buckets))), default=0)
    scale = height / (peak or 1)
    bar = 14
    rects = []
    for i, bucket in enumerate(buckets):
        y = float(height)
        for name, values in series.items():
            h = values[i] * scale
            if h:
                y -= h
                title = f"{bucket} {name}: {values[i]}"
                rects.append(_rect(i * (bar + 2), y, bar, h, COLOURS.get(name, OTHER), title))
    legend = [(COLOURS.get(n, OTHER), n, sum(v)) for n, v in series.items()]
    return Chart(max(1, len(buckets)) * (bar + 2), height, rects, legend, peak)
