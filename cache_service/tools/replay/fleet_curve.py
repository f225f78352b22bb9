"""The store's marginal curve: what the store adds on top of the engines' own caches, by
the store's capacity, for each routing (`--mrc` with `--engines`).

Each point is a whole fleet replay at one store capacity (the engines' caches as given), at
the capacities of the store-alone curves; the replays run side by side (`--jobs`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, TextIO

from cache_service.tools.replay.accesses import build_accesses
from cache_service.tools.replay.capacity_runs import run_points
from cache_service.tools.replay.curves import belady_capacities
from cache_service.tools.replay.engine import EmbeddedOptions, embedded_store
from cache_service.tools.replay.fleet import FleetOptions, drive_fleet
from cache_service.tools.replay.fleet_stats import TierTally
from cache_service.tools.replay.traces import TraceRequest

FleetKey = tuple[FleetOptions, int]  # (the fleet and its routing, the store's capacity in tokens)


def fleet_point(
    key: FleetKey, requests: Sequence[TraceRequest], options: EmbeddedOptions
) -> TierTally:
    """Prompt tokens by tier over the whole trace, at one store capacity."""
    fleet, capacity = key
    tally = TierTally()
    sized = replace(options, capacity_tokens=capacity)
    with embedded_store(sized) as store:
        drive_fleet(requests, sized, fleet, store, tally.add)
    return tally


def fleet_curves(
    requests: Sequence[TraceRequest],
    options: EmbeddedOptions,
    fleet: FleetOptions,
    routings: Sequence[str],
    *,
    extra_capacity_tokens: Sequence[int],
    kv_bytes_per_token: int,
    jobs: int,
    log: TextIO = sys.stderr,
) -> dict[str, list[dict[str, Any]]]:
    """Per routing, the tiers' shares at each store capacity of the store-alone curves."""
    accesses = build_accesses(requests, options.units)
    capacities = [
        blocks * accesses.block_tokens
        for blocks in belady_capacities(accesses, extra_capacity_tokens)
    ]
    keys = [(replace(fleet, routing=name), tokens) for name in routings for tokens in capacities]
    results = run_points(
        requests,
        options,
        keys,
        fleet_point,
        jobs=jobs,
        name=lambda key: f"fleet {key[0].routing} @{key[1]:,} store tokens",
        log=log,
    )
    curves: dict[str, list[dict[str, Any]]] = {}
    for (plan, tokens), tally in sorted(
        results.items(), key=lambda item: (routings.index(item[0][0].routing), item[0][1])
    ):
        curves.setdefault(plan.routing, []).append(
            {
                "capacity_tokens": tokens,
                "capacity_bytes": tokens * kv_bytes_per_token,
                **tally.as_dict(),
            }
        )
    return curves
