"""Benchmark rows: what was measured, by which client, and how it compares."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Row:
    """One measured figure (or a skipped peer, with the reason in `note`)."""

    scenario: str  # lookup, hashing, payload, store-size, replay, memory
    case: str  # e.g. "32k tokens, fully cached, c=16"
    subject: str  # what was measured: "ours", "framework floor", "redis", "lmdb", ...
    client: str  # what produced the figure: "our client", "redis-py+hiredis", "wrk", ...
    value: float | None  # the headline figure, in `unit`
    unit: str  # "ms", "req/s", "MB/s", "MiB", ...
    p50: float | None = None
    p99: float | None = None
    samples: int = 0
    ratio: float | None = None  # value / the reference's value
    ratio_to: str | None = None  # what `ratio` compares with
    cache_state: str = "warm page cache"
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def latency_row(
    scenario: str, case: str, subject: str, client: str, seconds: list[float], **extra: Any
) -> Row:
    """A latency row from per-call times: p50 as the value, in milliseconds."""
    ordered = sorted(seconds)
    p50 = statistics.median(ordered) * 1000
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000
    return Row(scenario, case, subject, client, p50, "ms", p50, p99, len(ordered), **extra)


def skipped(scenario: str, case: str, subject: str, reason: str) -> Row:
    """A row for a peer that could not run here."""
    return Row(scenario, case, subject, "-", None, "-", note=f"skipped: {reason}")


def compare(row: Row, reference: Row | None) -> Row:
    """Set row.ratio to row.value / reference.value (a share for rates, a multiple for times)."""
    if reference is None or reference.value in (None, 0) or row.value in (None, 0):
        return row
    assert reference.value is not None and row.value is not None
    row.ratio = row.value / reference.value
    row.ratio_to = f"{reference.subject} ({reference.client})"
    return row


def format_table(rows: list[Row]) -> str:
    """A plain text table of every row."""
    lines = [
        f"{'scenario':11} {'case':38} {'subject':24} {'client':20} {'value':>12} {'p99':>9} "
        f"{'ratio':>7}  note"
    ]
    for row in rows:
        value = "-" if row.value is None else f"{row.value:,.3f} {row.unit}"
        p99 = "-" if row.p99 is None else f"{row.p99:,.3f}"
        ratio = "-" if row.ratio is None else f"{row.ratio:.2f}x"
        note = row.note or (f"vs {row.ratio_to}" if row.ratio_to else "")
        lines.append(
            f"{row.scenario:11} {row.case[:38]:38} {row.subject[:24]:24} {row.client[:20]:20} "
            f"{value:>12} {p99:>9} {ratio:>7}  {note}"
        )
    return "\n".join(lines)


def write_json(rows: list[Row], path: Path, meta: dict[str, Any]) -> None:
    """The rows and the run's context as JSON."""
    path.write_text(json.dumps({**meta, "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
