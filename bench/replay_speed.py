"""Replay speed: requests per second of the embedded replay on a shared trace.

Usage: python bench/replay_speed.py [TRACE] [--runs 3]

Prints the median of several runs for each way of replaying, and, as a reference measured in
the same process, the cost of only reading the trace and computing its block keys (the part
of a replay no cache can avoid).
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

from bench import CONVERSATION_TRACE
from cache_service.core.eviction import DEFAULT_POLICY
from cache_service.core.hashing import BlockHasher
from cache_service.tools.replay.accesses import build_accesses
from cache_service.tools.replay.block_units import plan_units, request_namespace, request_tokens
from cache_service.tools.replay.command import ReplayConfig, load_traces, run_replay
from cache_service.tools.replay.mrc import lru_curve

DEFAULT_TRACE = CONVERSATION_TRACE


def _median_seconds(runs: int, work: Callable[[], object]) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    """Measure and print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE))
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    quiet = io.StringIO()
    requests = load_traces(ReplayConfig(traces=[args.trace]), log=quiet).requests
    units = plan_units(requests, None)
    hasher = BlockHasher()

    def keys_only() -> None:
        for request in requests:
            hasher.chain(
                request_namespace(request), request_tokens(request), block_size=units.cache_tokens
            )

    rows = [("read + block keys only (floor)", _median_seconds(args.runs, keys_only))]
    for label, store, capacity, policy in (
        ("embedded LMDB, unbounded", "lmdb", None, DEFAULT_POLICY),
        ("embedded LMDB, 3M-token LRU + ceiling run", "lmdb", 3_000_000, "lru"),
        ("embedded LMDB, 3M-token adaptive + ceiling", "lmdb", 3_000_000, "adaptive"),
        ("embedded memory store, unbounded", "memory", None, DEFAULT_POLICY),
    ):
        config = ReplayConfig(
            traces=[args.trace], store=store, capacity_tokens=capacity, policy=policy
        )
        rows.append((label, _median_seconds(args.runs, partial(run_replay, config, log=quiet))))
    accesses = build_accesses(requests, units)
    rows.append(
        (
            "LRU curve, every capacity (one pass)",
            _median_seconds(args.runs, lambda: lru_curve(accesses)),
        )
    )
    floor = rows[0][1]
    print(f"trace: {args.trace} ({len(requests):,} requests); median of {args.runs} runs")
    print(f"{'what':42} {'seconds':>8} {'requests/s':>11} {'x floor':>8}")
    for label, seconds in rows:
        print(f"{label:42} {seconds:8.2f} {len(requests) / seconds:11,.0f} {seconds / floor:8.1f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
