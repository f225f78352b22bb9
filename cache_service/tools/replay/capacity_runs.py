"""Replays of one trace at many (policy, capacity) pairs, spread over worker processes.

A policy other than LRU has no one-pass curve: each point of its capacity curve is a whole
replay. The replays are independent, so they run side by side, one per core (`--jobs`), each
in a process of its own with its own private store; the parent prints a line as each ends.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import replace
from typing import TextIO, TypeVar

from cache_service.tools.replay.engine import EmbeddedOptions, replay_embedded
from cache_service.tools.replay.policy_curves import Hits
from cache_service.tools.replay.stats import Outcome
from cache_service.tools.replay.traces import TraceRequest

RunKey = tuple[str, int]  # (policy, capacity in tokens)
K = TypeVar("K", bound=Hashable)
R = TypeVar("R")
# One whole replay at one key: (key, requests, options) -> its result.
Point = Callable[[K, Sequence[TraceRequest], EmbeddedOptions], R]

# What a worker process replays: set once per process by `_adopt`, so the trace is sent to
# each worker once rather than with every run.
_worker_requests: Sequence[TraceRequest] = ()
_worker_options: EmbeddedOptions | None = None
# Below this many requests a replay takes well under a second: starting worker processes
# (each imports the package and receives the trace) would cost more than it saves.
MIN_REQUESTS_FOR_PROCESSES = 2000


def default_jobs() -> int:
    """One worker per core this process may use."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)


def replay_hits(
    requests: Sequence[TraceRequest], options: EmbeddedOptions, policy: str, capacity: int
) -> Hits:
    """(hit blocks, hit tokens) of the trace under `policy` at `capacity` tokens."""
    totals = [0, 0]

    def count(outcome: Outcome, _retention: str) -> None:
        totals[0] += outcome.hit_blocks
        totals[1] += outcome.hit_tokens

    replay_embedded(requests, replace(options, policy=policy, capacity_tokens=capacity), count)
    return totals[0], totals[1]


def _replay_point(key: RunKey, requests: Sequence[TraceRequest], options: EmbeddedOptions) -> Hits:
    return replay_hits(requests, options, *key)


def _adopt(requests: Sequence[TraceRequest], options: EmbeddedOptions) -> None:
    global _worker_requests, _worker_options
    _worker_requests, _worker_options = requests, options


def _run(point: Point[K, R], key: K) -> R:
    assert _worker_options is not None
    return point(key, _worker_requests, _worker_options)


def run_points(
    requests: Sequence[TraceRequest],
    options: EmbeddedOptions,
    keys: Sequence[K],
    point: Point[K, R],
    *,
    jobs: int,
    name: Callable[[K], str],
    log: TextIO = sys.stderr,
) -> dict[K, R]:
    """`point` at every key (one whole replay each), `jobs` at a time; a line on `log` per
    run, naming it with `name`. `point` must be a module-level function (workers import it)."""
    pending = list(dict.fromkeys(keys))
    results: dict[K, R] = {}
    if not pending:
        return results
    started = time.perf_counter()

    def done(key: K, result: R) -> None:
        results[key] = result
        log.write(
            f"capacity curve: {name(key)} done ({len(results)}/{len(pending)}, "
            f"{time.perf_counter() - started:,.0f} s)\n"
        )
        log.flush()

    if jobs <= 1 or len(pending) == 1 or len(requests) < MIN_REQUESTS_FOR_PROCESSES:
        for key in pending:
            done(key, point(key, requests, options))
        return results
    # Spawned, not forked: the parent may hold threads and open stores a fork would copy.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        max_workers=min(jobs, len(pending)),
        mp_context=context,
        initializer=_adopt,
        initargs=(list(requests), options),
    ) as pool:
        futures: dict[Future[R], K] = {pool.submit(_run, point, key): key for key in pending}
        for future in as_completed(futures):
            done(futures[future], future.result())
    return results


def run_capacities(
    requests: Sequence[TraceRequest],
    options: EmbeddedOptions,
    keys: Sequence[RunKey],
    *,
    jobs: int,
    log: TextIO = sys.stderr,
) -> dict[RunKey, Hits]:
    """Every (policy, capacity) replay of `keys`, `jobs` at a time; a line on `log` per run."""
    return run_points(
        requests,
        options,
        keys,
        _replay_point,
        jobs=jobs,
        name=lambda key: f"{key[0]} @{key[1]:,} tokens",
        log=log,
    )
