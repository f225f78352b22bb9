"""Replay speed of the embedded replay on the public conversation trace (bench/traces)."""

from __future__ import annotations

import io
import tempfile
import time
from pathlib import Path

from bench import CONVERSATION_TRACE
from bench.report import Row, skipped
from bench.scenarios.context import Context
from cache_service.tools.replay.command import ReplayConfig, run_replay

TRACE = CONVERSATION_TRACE


def run(ctx: Context) -> list[Row]:
    """Requests per second, unbounded, on LMDB (quick: the first 2,000 requests)."""
    if not TRACE.exists():
        return [skipped("replay", "conversation trace", "ours", f"{TRACE} not found")]
    with tempfile.TemporaryDirectory() as folder:
        trace = TRACE
        if ctx.quick:
            trace = Path(folder) / "head.jsonl"
            with TRACE.open() as source:
                trace.write_text(
                    "".join(line for _, line in zip(range(2000), source, strict=False))
                )
        started = time.perf_counter()
        report = run_replay(ReplayConfig(traces=[str(trace)]), log=io.StringIO())
        elapsed = time.perf_counter() - started
    case = f"conversation trace, {report['requests']:,} requests, unbounded"
    row = Row("replay", case, "ours: embedded LMDB", "in-process", report["requests"] / elapsed,
              "req/s")  # fmt: skip
    row.extra["seconds"] = round(elapsed, 2)
    return [row]
