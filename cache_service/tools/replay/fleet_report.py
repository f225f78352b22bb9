"""The report's `fleet` section: each routing run with the store and without it, and what
the store adds on top of the engines' own caches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from cache_service.tools.replay.cost import Prices, fleet_cost
from cache_service.tools.replay.engine import EmbeddedOptions, embedded_store
from cache_service.tools.replay.fleet import FleetOptions, TierHits, drive_fleet
from cache_service.tools.replay.fleet_stats import FleetStats
from cache_service.tools.replay.progress import Progress
from cache_service.tools.replay.traces import TraceRequest


def run_fleet(
    requests: Sequence[TraceRequest],
    options: EmbeddedOptions,
    fleet: FleetOptions,
    *,
    with_store: bool,
    window_seconds: float,
) -> FleetStats:
    """One fleet replay, with progress; its tallies."""
    stats = FleetStats(fleet.engines, window_seconds)
    label = f"fleet {fleet.routing}" + ("" if with_store else ", no store")
    progress = Progress(len(requests), label=label)

    def count(request: TraceRequest, tiers: TierHits) -> None:
        stats.add(request, tiers)
        progress.advance()

    try:
        if with_store:
            with embedded_store(options) as store:
                drive_fleet(requests, options, fleet, store, count)
        else:
            drive_fleet(requests, options, fleet, None, count)
    finally:
        progress.close()
    return stats


def fleet_section(
    requests: Sequence[TraceRequest],
    options: EmbeddedOptions,
    fleet: FleetOptions,
    routings: Sequence[str],
    *,
    window_seconds: float,
    kv_bytes_per_token: int,
    prices: Prices,
) -> dict[str, Any]:
    """Every routing with and without the store (docs/content/guides/replay.md: Fleets)."""
    by_routing: dict[str, Any] = {}
    for name in routings:
        plan = replace(fleet, routing=name)
        stored = run_fleet(requests, options, plan, with_store=True, window_seconds=window_seconds)
        alone = run_fleet(requests, options, plan, with_store=False, window_seconds=window_seconds)
        gb_days = stored.store_gb_days(kv_bytes_per_token)
        with_store = stored.total
        engines_only = alone.total
        hits_with = with_store.engine_tokens + with_store.store_tokens
        by_routing[name] = {
            "with_store": {
                **with_store.as_dict(),
                "cost": fleet_cost(
                    hits_with, with_store.miss_tokens, with_store.output_tokens, gb_days, prices
                ),
                "by_engine": [tally.as_dict() for tally in stored.by_engine],
                "windows": stored.window_points(),
            },
            "engines_only": {
                **engines_only.as_dict(),
                "cost": fleet_cost(
                    engines_only.engine_tokens,
                    engines_only.miss_tokens,
                    engines_only.output_tokens,
                    0.0,
                    prices,
                ),
                "by_engine": [tally.as_dict() for tally in alone.by_engine],
            },
            "store_adds_tokens": hits_with - engines_only.engine_tokens,
            "store_adds_share": round(
                (hits_with - engines_only.engine_tokens) / with_store.prompt_tokens, 6
            )
            if with_store.prompt_tokens
            else 0.0,
            "per_request": stored.per_request,
        }
    return {
        "engines": fleet.engines,
        "engine_cache_blocks": fleet.engine_cache_blocks,
        "engine_block_tokens": fleet.engine_block_tokens,
        # vLLM's null block holds nothing.
        "engine_cache_tokens": (fleet.engine_cache_blocks - 1) * fleet.engine_block_tokens,
        "store_capacity_tokens": options.capacity_tokens,
        "store_price_per_gb_day": prices.store_per_gb_day,
        "window_seconds": window_seconds,
        "routings": by_routing,
        "curves": None,  # with --mrc: the store's marginal curve per routing (fleet_curve)
    }
