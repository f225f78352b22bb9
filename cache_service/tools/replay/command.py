"""`cache-service replay`: load traces, replay them, and build the report."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from cache_service.core.eviction import DEFAULT_POLICY
from cache_service.core.retention import RetentionPolicy
from cache_service.tools.replay.accesses import build_accesses
from cache_service.tools.replay.block_units import BlockUnits, plan_units
from cache_service.tools.replay.capacity_runs import RunKey, default_jobs, run_capacities
from cache_service.tools.replay.cost import Prices, cost_report
from cache_service.tools.replay.curves import (
    CurvePlan,
    Scale,
    belady_capacities,
    belady_section,
    curve_section,
)
from cache_service.tools.replay.engine import (
    EmbeddedOptions,
    HttpOptions,
    ReplayError,
    replay_embedded,
    replay_http,
)
from cache_service.tools.replay.fleet import FleetOptions
from cache_service.tools.replay.fleet_curve import fleet_curves
from cache_service.tools.replay.fleet_report import fleet_section
from cache_service.tools.replay.mrc import lru_curve
from cache_service.tools.replay.policy_curves import Hits, compare_policies
from cache_service.tools.replay.progress import Progress
from cache_service.tools.replay.routing import ROUTINGS
from cache_service.tools.replay.stats import Outcome, ReplayStats
from cache_service.tools.replay.traces import TraceError, TraceRequest, read_trace

MAX_ERRORS_SHOWN = 20
MAX_WINDOWS = 500  # automatic windows widen (in whole minutes) to keep about this many


def window_width(requests: Sequence[TraceRequest], chosen: float | None) -> float:
    """The hit-ratio-over-time window: as chosen, else a minute, or wider for a long trace."""
    if chosen is not None:
        if chosen <= 0:
            raise ReplayError("--window-seconds must be positive")
        return chosen
    span = requests[-1].timestamp - requests[0].timestamp if requests else 0.0
    return max(60.0, math.ceil(span / MAX_WINDOWS / 60.0) * 60.0)


@dataclass
class ReplayConfig:
    """Everything `cache-service replay` can be told."""

    traces: Sequence[str]
    fmt: str = "auto"
    url: str | None = None
    api_key: str | None = None
    capacity_tokens: int | None = None
    policy: str = DEFAULT_POLICY
    # Policies compared against LRU and Belady on the curves (needs mrc); empty: `policy`.
    compare: Sequence[str] = ()
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    speed: float | None = None
    block_size: int | None = None
    payload_bytes_per_token: int = 0
    mrc: bool = False
    capacities: Sequence[int] = ()
    kv_bytes_per_token: int = 890
    prices: Prices = field(default_factory=Prices)
    window_seconds: float | None = None  # None: a minute, wider for traces of days
    strict: bool = False
    store: str = "lmdb"
    workdir: Path | None = None
    jobs: int = field(default_factory=default_jobs)  # replays of the curves run side by side
    # Engines with their own prefix caches in front of the store (None: the store alone), and
    # the routings to compare.
    fleet: FleetOptions | None = None
    routings: Sequence[str] = ROUTINGS


@dataclass
class LoadedTraces:
    """The requests of every trace, in replay order, and the lines that were skipped."""

    requests: list[TraceRequest]
    errors: list[TraceError]


def load_traces(config: ReplayConfig, *, log: TextIO = sys.stderr) -> LoadedTraces:
    """Read every trace; a bad line is reported with its number and skipped (or, strict, fatal).

    Requests are replayed by timestamp; equal timestamps keep file order, then line order.
    """
    requests: list[TraceRequest] = []
    errors: list[TraceError] = []
    classes = config.retention.ttl_seconds
    for source, path in enumerate(config.traces):
        for read in read_trace(path, fmt=config.fmt, source=source, strict=config.strict):
            item = read
            if isinstance(read, TraceRequest) and read.retention not in (None, *classes):
                item = TraceError(
                    path,
                    read.line,
                    f"retention class {read.retention!r} is not configured "
                    f"({', '.join(sorted(classes))}; see --retention-map)",
                )
                if config.strict:
                    raise item
            if isinstance(item, TraceError):
                errors.append(item)
                if len(errors) <= MAX_ERRORS_SHOWN:
                    log.write(f"skipped {item}\n")
            else:
                requests.append(item)
    if len(errors) > MAX_ERRORS_SHOWN:
        log.write(f"... and {len(errors) - MAX_ERRORS_SHOWN} more skipped lines\n")
    requests.sort(key=lambda request: request.timestamp)  # stable: file, then line order
    return LoadedTraces(requests, errors)


def _embedded(
    config: ReplayConfig, units: BlockUnits, capacity_tokens: int | None
) -> EmbeddedOptions:
    return EmbeddedOptions(
        units=units,
        retention=config.retention,
        capacity_tokens=capacity_tokens,
        policy=config.policy,
        payload_bytes_per_token=config.payload_bytes_per_token,
        store=config.store,
        workdir=config.workdir,
    )


def _replay(
    requests: Sequence[TraceRequest],
    config: ReplayConfig,
    units: BlockUnits,
    *,
    capacity_tokens: int | None,
    label: str,
    over_http: bool = False,
) -> ReplayStats:
    stats = ReplayStats(window_seconds=window_width(requests, config.window_seconds))
    progress = Progress(len(requests), label=label)

    def count(outcome: Outcome, retention: str) -> None:
        stats.add(outcome, retention=retention)
        progress.advance()

    try:
        if over_http:
            assert config.url is not None
            options = HttpOptions(
                url=config.url,
                units=units,
                speed=config.speed,
                payload_bytes_per_token=config.payload_bytes_per_token,
                api_key=config.api_key,
            )
            replay_http(requests, options, count)
        else:
            replay_embedded(requests, _embedded(config, units, capacity_tokens), count)
    finally:
        progress.close()
    return stats


def _ttls_may_expire(requests: Sequence[TraceRequest], retention: RetentionPolicy) -> bool:
    """Whether some block could outlive its TTL within the trace's span."""
    if not requests:
        return False
    span = requests[-1].timestamp - requests[0].timestamp
    used = {request.retention or retention.default_class for request in requests}
    return any(span >= retention.ttl_seconds[name] for name in used)


def run_replay(config: ReplayConfig, *, log: TextIO = sys.stderr) -> dict[str, Any]:
    """Replay the traces and return the report (docs/content/guides/replay.md lists its fields)."""
    if config.url is not None and config.capacity_tokens is not None:
        raise ReplayError("--capacity-tokens needs the embedded cache: a service has its own")
    if config.fleet is not None and config.url is not None:
        raise ReplayError("--engines simulates the engines and the store: drop --url")
    if len(config.compare) > 1 and not config.mrc:
        raise ReplayError(
            f"--policy {','.join(config.compare)} compares policies, which needs --mrc; "
            "without it, name one policy"
        )
    loaded = load_traces(config, log=log)
    requests = loaded.requests
    if not requests:
        raise ReplayError("no valid request in the traces")
    try:
        units = plan_units(requests, config.block_size)
    except ValueError as exc:
        raise ReplayError(str(exc)) from None
    started = time.perf_counter()
    main = _replay(
        requests,
        config,
        units,
        capacity_tokens=config.capacity_tokens,
        label="replay",
        over_http=config.url is not None,
    )
    elapsed = time.perf_counter() - started
    ceiling = main.total
    if config.url is not None or config.capacity_tokens is not None:
        ceiling = _replay(requests, config, units, capacity_tokens=None, label="ceiling").total
    report: dict[str, Any] = {
        "capacity_tokens": config.capacity_tokens,
        "policy": config.policy,
        **main.total.as_dict(),
        "mode": "http" if config.url else f"embedded-{config.store}",
        "url": config.url,
        "traces": [str(path) for path in config.traces],
        "block_tokens": units.trace_tokens,
        "cache_block_tokens": units.cache_tokens,
        "skipped_lines": len(loaded.errors),
        "elapsed_seconds": round(elapsed, 3),
        "requests_per_second": round(len(requests) / elapsed, 1) if elapsed else None,
        "ceiling": ceiling.as_dict(),
        "by_retention": {name: t.as_dict() for name, t in sorted(main.by_retention.items())},
        "by_tenant": (
            {name: t.as_dict() for name, t in sorted(main.by_tenant.items())}
            if config.url is None
            else None
        ),
        "windows": {"window_seconds": main.window_seconds, "points": main.window_points()},
        "mrc": None,
        "lru": None,
        "belady": None,
        "policies": None,
        "cost": cost_report(main.total, config.prices),
        "ceiling_cost": cost_report(ceiling, config.prices),
        "fleet": None,
    }
    if config.fleet is not None:
        report["fleet"] = fleet_section(
            requests,
            _embedded(config, units, config.capacity_tokens),
            config.fleet,
            config.routings,
            window_seconds=main.window_seconds,
            kv_bytes_per_token=config.kv_bytes_per_token,
            prices=config.prices,
        )
        if config.mrc:
            extra = [*config.capacities]
            if config.capacity_tokens is not None:
                extra.append(config.capacity_tokens)
            report["fleet"]["curves"] = fleet_curves(
                requests,
                _embedded(config, units, None),
                config.fleet,
                config.routings,
                extra_capacity_tokens=extra,
                kv_bytes_per_token=config.kv_bytes_per_token,
                jobs=config.jobs,
                log=log,
            )
    if config.mrc:
        report.update(_curves(requests, config, units, log=log))
    return report


class _Replays:
    """Replays at one capacity under one policy, each run once (the curves share them)."""

    def __init__(
        self, requests: Sequence[TraceRequest], config: ReplayConfig, units: BlockUnits, log: TextIO
    ) -> None:
        self.requests = requests
        self.options = _embedded(config, units, None)
        self.jobs = config.jobs
        self.log = log
        self.done: dict[RunKey, Hits] = {}

    def run(self, keys: Sequence[RunKey]) -> None:
        """Run the replays of `keys` not run yet, side by side."""
        missing = [key for key in dict.fromkeys(keys) if key not in self.done]
        self.done.update(
            run_capacities(self.requests, self.options, missing, jobs=self.jobs, log=self.log)
        )

    def at(self, policy: str, capacity_tokens: int) -> Hits:
        """(hit blocks, hit tokens) of the trace under `policy` at a capacity."""
        self.run([(policy, capacity_tokens)])
        return self.done[(policy, capacity_tokens)]


def _curves(
    requests: Sequence[TraceRequest], config: ReplayConfig, units: BlockUnits, *, log: TextIO
) -> dict[str, Any]:
    """The `mrc` (the policy's own curve), `lru`, `belady` and `policies` sections (the last
    None when only LRU is named)."""
    accesses = build_accesses(requests, units)
    stack_exact = not _ttls_may_expire(requests, config.retention)
    extra = list(config.capacities)
    if config.capacity_tokens is not None:
        extra.append(config.capacity_tokens)
    replays = _Replays(requests, config, units, log)
    lru_plan = CurvePlan(extra, config.kv_bytes_per_token, stack_distance=stack_exact)
    plan = replace(lru_plan, stack_distance=config.policy == "lru" and stack_exact)
    names = list(dict.fromkeys(config.compare or [config.policy]))
    # Every replay the sections below read, run side by side first: the policy's own curve,
    # the compared policies, and LRU unless its stack distances are exact.
    tokens = [c * accesses.block_tokens for c in belady_capacities(accesses, extra)]
    replayed = list(dict.fromkeys([config.policy, *names, "lru"]))
    if stack_exact:
        replayed.remove("lru")
    replays.run([(name, capacity) for name in replayed for capacity in tokens])
    exact_lru = lru_curve(accesses) if stack_exact else None  # one pass serves every use

    def curve_of(policy: str, curve_plan: CurvePlan) -> dict[str, Any]:
        return curve_section(
            accesses, curve_plan, lambda capacity: replays.at(policy, capacity), lru=exact_lru
        )

    mrc = curve_of(config.policy, plan)
    sections: dict[str, Any] = {
        "mrc": mrc,
        "lru": mrc if config.policy == "lru" else curve_of("lru", lru_plan),
        "belady": belady_section(accesses, plan),
        "policies": None,
    }
    if names != ["lru"]:
        sections["policies"] = compare_policies(
            names,
            sections["belady"],
            Scale.of(accesses, config.kv_bytes_per_token),
            replay_at=replays.at,
            lru_exact=exact_lru,
        )
    return sections
