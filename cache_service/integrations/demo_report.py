"""The demo's rows, its table and its summary. Plain Python: nothing here loads a model."""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONTINUATION_CHARS = 60
COLUMNS = (
    ("scenario", 8),
    ("turn", 4),
    ("prompt", 6),
    ("cached", 6),
    ("with cache", 10),
    ("without", 9),
    ("speed-up", 8),
    ("same", 4),
)


@dataclass(frozen=True, slots=True)
class Row:
    """One turn: its prompt, what the cache held of it, both prefills' times, and the
    greedy continuations with and without the cache."""

    scenario: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    cached_seconds: float  # the worker's time to the first token: lookup, load, compute
    uncached_seconds: float  # the model on the whole prompt
    lookup_seconds: float
    load_seconds: float
    compute_seconds: float
    store_seconds: float  # after the first token
    identical: bool  # the greedy continuations with and without the cache are the same
    continuation: str
    continuation_tokens: list[int]

    @property
    def speedup(self) -> float:
        """The prefill's time without the cache over its time with it."""
        return self.uncached_seconds / self.cached_seconds


def header() -> str:
    """The table's header line."""
    cells = [
        name.ljust(width) if i == 0 else name.rjust(width)
        for i, (name, width) in enumerate(COLUMNS)
    ]
    return "  ".join(cells) + "  continuation"


def format_row(row: Row) -> str:
    """One turn as a line of the table."""
    values = (
        row.scenario,
        str(row.turn),
        str(row.prompt_tokens),
        str(row.cached_tokens),
        f"{row.cached_seconds:.3f} s",
        f"{row.uncached_seconds:.3f} s",
        f"{row.speedup:.2f}x",
        "yes" if row.identical else "NO",
    )
    cells = [
        value.ljust(width) if i == 0 else value.rjust(width)
        for i, (value, (_, width)) in enumerate(zip(values, COLUMNS, strict=True))
    ]
    return "  ".join(cells) + "  " + one_line(row.continuation)


def one_line(text: str, chars: int = CONTINUATION_CHARS) -> str:
    """`text` on one line (white space collapsed), cut to `chars` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= chars else flat[: chars - 1] + "…"


def summarize(rows: Sequence[Row]) -> dict[str, Any]:
    """Prompt tokens, the cached share, the median speed-up of the turns with a cache hit,
    and how many turns' continuations were identical."""
    prompt = sum(row.prompt_tokens for row in rows)
    cached = sum(row.cached_tokens for row in rows)
    hits = [row.speedup for row in rows if row.cached_tokens > 0]
    return {
        "turns": len(rows),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": cached / prompt if prompt else 0.0,
        "hit_turns": len(hits),
        "median_speedup_of_hits": statistics.median(hits) if hits else None,
        "identical_turns": sum(row.identical for row in rows),
    }


def format_summary(summary: Mapping[str, Any]) -> str:
    """The summary line."""
    line = (
        f"total: {summary['prompt_tokens']} prompt tokens, {summary['cached_tokens']} cached "
        f"({summary['cached_share']:.0%}); "
    )
    if summary["hit_turns"]:
        line += (
            f"median speed-up of the {summary['hit_turns']} turns with a cache hit: "
            f"{summary['median_speedup_of_hits']:.2f}x; "
        )
    else:
        line += "no turn had a cache hit; "
    return line + (
        f"greedy continuation identical with and without the cache on "
        f"{summary['identical_turns']} of {summary['turns']} turns"
    )


def write_json(path: Path, rows: Sequence[Row], **fields: Any) -> None:
    """The run's fields, its rows (each with its speed-up) and its summary, as JSON."""
    document = {
        **fields,
        "rows": [{**dataclasses.asdict(row), "speedup": row.speedup} for row in rows],
        "summary": summarize(rows),
    }
    path.write_text(json.dumps(document, indent=2) + "\n")
