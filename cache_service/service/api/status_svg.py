"""Inline SVG for the status page: a line chart over time and a bar of used against room.

Plain strings, no script and no external reference: the page's Content-Security-Policy
allows neither (and SVG inline in HTML needs no namespace URL). Every text that goes into
the SVG is escaped here.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

WIDTH, HEIGHT = 640, 170
LEFT, RIGHT, TOP, BOTTOM = 46, 12, 10, 24  # room for the axes' labels
LINE = "#2563eb"
AREA = "#2563eb22"
GRID = "#d4d4d8"
INK = "#52525b"
OK, WARN, FULL = "#16a34a", "#d97706", "#dc2626"


def _x(seconds_ago: float, span_seconds: float) -> float:
    return LEFT + (1 - seconds_ago / span_seconds) * (WIDTH - LEFT - RIGHT)


def _y(value: float, y_max: float) -> float:
    return TOP + (1 - min(max(value / y_max, 0.0), 1.0)) * (HEIGHT - TOP - BOTTOM)


def _runs(
    points: Sequence[tuple[float, float | None]],
) -> list[list[tuple[float, float]]]:
    """Consecutive points with a value; a point without one (no traffic) breaks the line."""
    runs: list[list[tuple[float, float]]] = [[]]
    for ago, value in points:
        if value is None:
            if runs[-1]:
                runs.append([])
        else:
            runs[-1].append((ago, value))
    return [run for run in runs if run]


def time_chart(
    points: Sequence[tuple[float, float | None]],
    *,
    span_seconds: float,
    x_ticks: Sequence[tuple[float, str]],
    y_ticks: Sequence[tuple[float, str]],
    y_max: float,
    label: str,
    empty_note: str,
) -> str:
    """A line (with the area under it) of (seconds ago, value) points over the last
    `span_seconds`; `empty_note` written across it when no point has a value."""
    parts = [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="{escape(label)}">',
        f"<title>{escape(label)}</title>",
    ]
    base = _y(0, y_max)
    for value, text in y_ticks:
        y = _y(value, y_max)
        parts.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" '
                     f'stroke="{GRID}" stroke-width="1"/>')  # fmt: skip
        parts.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end" '
                     f'fill="{INK}" font-size="11">{escape(text)}</text>')  # fmt: skip
    for ago, text in x_ticks:
        x = _x(ago, span_seconds)
        parts.append(f'<line x1="{x:.1f}" y1="{base:.1f}" x2="{x:.1f}" y2="{base + 4:.1f}" '
                     f'stroke="{INK}" stroke-width="1"/>')  # fmt: skip
        parts.append(f'<text x="{x:.1f}" y="{HEIGHT - 6}" text-anchor="middle" '
                     f'fill="{INK}" font-size="11">{escape(text)}</text>')  # fmt: skip
    runs = _runs([(ago, value) for ago, value in points if 0 <= ago <= span_seconds])
    for run in runs:
        coords = [(_x(ago, span_seconds), _y(value, y_max)) for ago, value in run]
        if len(coords) == 1:
            (x, y), = coords  # fmt: skip
            parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{LINE}"/>')
            continue
        line = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
        area = f"{coords[0][0]:.1f},{base:.1f} {line} {coords[-1][0]:.1f},{base:.1f}"
        parts.append(f'<polygon points="{area}" fill="{AREA}" stroke="none"/>')
        parts.append(f'<polyline points="{line}" fill="none" stroke="{LINE}" '
                     'stroke-width="1.8" stroke-linejoin="round"/>')  # fmt: skip
    if not runs:
        parts.append(f'<text x="{(LEFT + WIDTH - RIGHT) / 2:.1f}" y="{(TOP + base) / 2:.1f}" '
                     f'text-anchor="middle" fill="{INK}" font-size="13">'
                     f"{escape(empty_note)}</text>")  # fmt: skip
    parts.append("</svg>")
    return "".join(parts)


def usage_bar(used: int, room: int | None, *, label: str) -> str:
    """A bar of `used` against `room` (green, amber past 80 %, red past 95 %); nothing when
    there is no limit to compare with."""
    if not room:
        return ""
    fraction = min(used / room, 1.0)
    colour = FULL if fraction > 0.95 else WARN if fraction > 0.8 else OK
    filled = fraction * 100
    return (
        f'<svg class="bar" viewBox="0 0 100 6" preserveAspectRatio="none" role="img" '
        f'aria-label="{escape(label)}">'
        f"<title>{escape(label)}</title>"
        f'<rect x="0" y="0" width="100" height="6" fill="#f4f4f5"/>'
        f'<rect x="0" y="0" width="{filled:.2f}" height="6" fill="{colour}"/>'
        "</svg>"
    )
