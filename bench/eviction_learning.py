"""What `adaptive` eviction loses when its learning is split over workers or restarted.

`adaptive` learns its protection (m eviction horizons, cache_service/core/eviction/adaptive.py)
from the evictions it sees, starting from LRU (m = 0). What it learned lives in one Python
object per process: under `cache-service serve --workers N` each worker has its own, which
sees only the ranks, hits and evictions of the requests that worker serves, while all share
one store (one use sequence, one victims index: eviction takes the lowest-ranked leaf of the
whole store); and after a restart the policy starts over from LRU, while the store keeps
every block with its record (rank, hits, last use) and its use sequence.

This bench replays a trace at 3M tokens (5,859 blocks of 512) with the replay's own driver
over a memory store, and reports the block hit ratio of: LRU; adaptive with one learner (what
`cache-service replay --policy adaptive --store memory` gives); adaptive with N learners,
requests dealt round-robin (request i goes to worker i mod N); and adaptive whose learner is
replaced by a fresh one every K requests.

Why a dispatching policy is faithful: the store calls its policy only inside the request that
caused the call. `PrefixCache.lookup_and_fill` runs a request's lookup, hit, insert and the
evictions that make room for it in one write transaction (begin ... commit), and the driver
reports each outcome before it starts the next request, so choosing the next worker on that
report routes every call to the worker serving the request. (A server runs the same calls in
the worker that took the request; its background sweep of expired blocks teaches no policy.)

Usage: python -m bench.eviction_learning [--traces conversation,synthetic] [--json PATH]
The Markdown table goes to stdout, progress to stderr; a run takes about 70 s on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import CONVERSATION_TRACE, SYNTHETIC_TRACE
from cache_service.core.blocks import BlockMeta
from cache_service.core.eviction import AdaptivePolicy, EvictionPolicy, Use, make_policy
from cache_service.core.retention import RetentionPolicy
from cache_service.core.store.memory import MemoryStore
from cache_service.tools.replay.block_units import plan_units
from cache_service.tools.replay.capacity_runs import default_jobs
from cache_service.tools.replay.command import ReplayConfig, load_traces
from cache_service.tools.replay.engine import EmbeddedOptions, drive_store
from cache_service.tools.replay.stats import Outcome, Tally

CAPACITY_TOKENS = 2_999_808  # 3M tokens: 5,859 blocks of 512
TRACES = {"conversation": CONVERSATION_TRACE, "synthetic": SYNTHETIC_TRACE}
WORKERS = (2, 4)
RESTART_EVERY = (1000, 5000)
PROGRESS_REQUESTS = 4000  # a progress line per this many requests of a replay


class WorkerPolicies:
    """An EvictionPolicy that forwards every call to the policy of the worker serving the
    current request: N learners over one store, as `serve --workers N` runs them."""

    def __init__(self, policy: str, *, workers: int = 1) -> None:
        self.name = policy
        self.policies = [make_policy(policy) for _ in range(workers)]
        self.worker = 0
        self.current: EvictionPolicy = self.policies[0]

    def serve(self, worker: int) -> None:
        """The next request is served by `worker` (between requests only)."""
        self.worker, self.current = worker, self.policies[worker]

    def restart(self) -> None:
        """Every worker starts over with a fresh policy; the store keeps its records."""
        self.policies = [make_policy(self.name) for _ in self.policies]
        self.current = self.policies[self.worker]

    def rank(self, meta: BlockMeta, *, seq: int, use: Use) -> int:
        """The serving worker's rank."""
        return self.current.rank(meta, seq=seq, use=use)

    def child_removed(self, parent: BlockMeta, child: BlockMeta) -> None:
        """As the serving worker's policy does."""
        self.current.child_removed(parent, child)

    def evicted(self, meta: BlockMeta, *, held_blocks: int) -> None:
        """Only the worker whose request made the room learns of the eviction."""
        self.current.evicted(meta, held_blocks=held_blocks)

    def begin(self) -> None:
        """The serving worker's transaction begins."""
        self.current.begin()

    def commit(self) -> None:
        """The serving worker's transaction committed."""
        self.current.commit()

    def abort(self) -> None:
        """The serving worker's transaction aborted."""
        self.current.abort()

    def multiple(self) -> float:
        """The serving worker's protection in horizons (0 for a policy that learns none)."""
        return self.current.multiple if isinstance(self.current, AdaptivePolicy) else 0.0


@dataclass(frozen=True, slots=True)
class Setup:
    """How a policy runs: how many workers learn apart, and how often they restart."""

    label: str
    policy: str
    workers: int = 1
    restart_every: int | None = None  # requests; None: never


def setups(workers: Sequence[int], restart_every: Sequence[int]) -> list[Setup]:
    """The table's rows: LRU, one learner, then each split and each restart period."""
    return [
        Setup("lru", "lru"),
        Setup("adaptive, one learner", "adaptive"),
        *(Setup(f"adaptive, {n} workers", "adaptive", workers=n) for n in workers),
        *(
            Setup(f"adaptive, restarted every {k:,} requests", "adaptive", restart_every=k)
            for k in restart_every
        ),
    ]


def replay(
    path: Path, setup: Setup, *, capacity_tokens: int = CAPACITY_TOKENS, trace: str = ""
) -> dict[str, Any]:
    """Replay the trace at `path` under `setup`: its totals, mean m and seconds."""
    started = time.perf_counter()
    requests = load_traces(ReplayConfig(traces=[str(path)])).requests
    options = EmbeddedOptions(
        units=plan_units(requests, None),
        retention=RetentionPolicy(),  # the replay's default, as `run_replay` has it
        capacity_tokens=capacity_tokens,
        policy=setup.policy,
        store="memory",
    )
    policies = WorkerPolicies(setup.policy, workers=setup.workers)
    store = MemoryStore(policy=policies, lifetimes=options.retention.lifetimes())
    tally = Tally()
    multiples = [0.0]  # m of the learner that served each request, summed

    def count(outcome: Outcome, _retention: str) -> None:
        # Called between requests: the next one's worker (and any restart) is set here.
        tally.add(outcome)
        multiples[0] += policies.multiple()
        served = tally.requests
        if setup.restart_every and served % setup.restart_every == 0:
            policies.restart()
        policies.serve(served % setup.workers)
        if served % PROGRESS_REQUESTS == 0:
            seconds = time.perf_counter() - started
            print(
                f"  {trace} {setup.label}: {served:,}/{len(requests):,} ({seconds:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

    try:
        drive_store(requests, options, store, count)
    finally:
        store.close()
    return {
        **tally.as_dict(),
        "mean_multiple": round(multiples[0] / max(tally.requests, 1), 3),
        "seconds": round(time.perf_counter() - started, 1),
    }


def _run(job: tuple[str, Path, Setup, int]) -> dict[str, Any]:
    trace, path, setup, capacity_tokens = job
    return replay(path, setup, capacity_tokens=capacity_tokens, trace=trace)


def run(
    traces: dict[str, Path], rows: Sequence[Setup], *, capacity_tokens: int, jobs: int
) -> dict[str, dict[str, dict[str, Any]]]:
    """Every setup on every trace, `jobs` replays at a time: results by trace, then label."""
    work = [
        (trace, path, setup, capacity_tokens) for trace, path in traces.items() for setup in rows
    ]
    results: dict[tuple[str, str], dict[str, Any]] = {}
    started = time.perf_counter()
    # Spawned, not forked, as the replay's own curves are (capacity_runs): no inherited state.
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures: dict[Future[dict[str, Any]], tuple[str, Setup]] = {
            pool.submit(_run, job): (job[0], job[2]) for job in work
        }
        for future in as_completed(futures):
            trace, setup = futures[future]
            results[(trace, setup.label)] = result = future.result()
            print(
                f"{trace} {setup.label}: {result['block_hit_ratio']:.4f} ({len(results)}/"
                f"{len(work)}, {time.perf_counter() - started:.0f} s)",
                file=sys.stderr,
            )
    return {trace: {s.label: results[(trace, s.label)] for s in rows} for trace in traces}


def markdown(report: dict[str, Any]) -> str:
    """The table, with how and when it was measured."""
    lines = [
        f"`{report['command']}`, {report['date']}, {report['seconds']:.0f} s in all "
        f"({report['jobs']} replays at a time). Block hit ratio at "
        f"{report['capacity_tokens']:,} tokens; workers get requests round-robin; "
        "mean m: the serving learner's protection in eviction horizons, averaged over requests.",
        "",
        "| trace | setup | block hit ratio | vs one learner | mean m | seconds |",
        "|---|---|---:|---:|---:|---:|",
    ]
    restarts = {setup["label"]: setup["restart_every"] for setup in report["setups"]}
    for trace, rows in report["results"].items():
        base = rows["adaptive, one learner"]["block_hit_ratio"]
        for label, row in rows.items():
            ratio = row["block_hit_ratio"]
            every = restarts.get(label)
            note = " (never: the trace is shorter)" if every and every >= row["requests"] else ""
            lines.append(
                f"| {trace} | {label}{note} | {ratio:.4f} | {ratio - base:+.4f} | "
                f"{row['mean_multiple']:.2f} | {row['seconds']:.0f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Command line: python -m bench.eviction_learning [--traces ...] [--json PATH] ..."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.eviction_learning", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--traces", default=",".join(TRACES), help="default: every trace")
    parser.add_argument("--capacity-tokens", type=int, default=CAPACITY_TOKENS)
    parser.add_argument("--workers", default=",".join(map(str, WORKERS)))
    parser.add_argument("--restart-every", default=",".join(map(str, RESTART_EVERY)))
    parser.add_argument("--jobs", type=int, default=default_jobs(), help="replays at a time")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    names = [name for name in args.traces.split(",") if name]
    unknown = [name for name in names if name not in TRACES]
    if unknown:
        parser.error(f"unknown trace {', '.join(unknown)} (known: {', '.join(TRACES)})")
    rows = setups(
        [int(n) for n in args.workers.split(",") if n],
        [int(k) for k in args.restart_every.split(",") if k],
    )
    command = " ".join(["python -m bench.eviction_learning", *(argv or sys.argv[1:])])
    started = time.perf_counter()
    results = run(
        {name: TRACES[name] for name in names},
        rows,
        capacity_tokens=args.capacity_tokens,
        jobs=max(1, args.jobs),
    )
    report = {
        "command": command,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "capacity_tokens": args.capacity_tokens,
        "jobs": max(1, args.jobs),
        "deal": "round-robin",
        "seconds": round(time.perf_counter() - started, 1),
        "setups": [asdict(setup) for setup in rows],
        "results": results,
    }
    print(markdown(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
