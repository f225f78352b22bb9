"""What the cache saves: the bill at per-token prices, and the prefill compute not spent."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cache_service.tools.replay.stats import Tally

PER_MILLION = 1e6
# What keeping a GB (10^9 bytes) in the store costs a day: an SSD volume's list price, about
# $0.12 per GB-month (cloud block storage ranges $0.08-0.17).
DEFAULT_STORE_GB_DAY = 0.004


@dataclass(frozen=True, slots=True)
class Prices:
    """Dollars per million tokens of each kind, and the model's active parameters."""

    hit_per_million: float = 0.003
    miss_per_million: float = 0.15
    output_per_million: float = 0.60
    active_parameters: float = 8e9
    store_per_gb_day: float = DEFAULT_STORE_GB_DAY


def token_bill(hit_tokens: int, miss_tokens: int, output_tokens: int, prices: Prices) -> float:
    """Dollars for prompt tokens hit and missed, and for output tokens."""
    return (
        hit_tokens * prices.hit_per_million
        + miss_tokens * prices.miss_per_million
        + output_tokens * prices.output_per_million
    ) / PER_MILLION


def cost_report(tally: Tally, prices: Prices) -> dict[str, Any]:
    """The bill with and without the cache, and the prefill FLOPs the hits saved."""
    with_cache = token_bill(tally.hit_tokens, tally.miss_tokens, tally.output_tokens, prices)
    without_cache = token_bill(0, tally.prompt_tokens, tally.output_tokens, prices)
    saved = without_cache - with_cache
    return {
        "prices_per_million_tokens": {
            "cache_hit": prices.hit_per_million,
            "cache_miss": prices.miss_per_million,
            "output": prices.output_per_million,
        },
        "with_cache_usd": round(with_cache, 6),
        "without_cache_usd": round(without_cache, 6),
        "saved_usd": round(saved, 6),
        "saved_share": round(saved / without_cache, 6) if without_cache else 0.0,
        "active_parameters": prices.active_parameters,
        # 2 FLOPs per parameter per token: a lower bound, attention is left out.
        "prefill_flops_saved": tally.hit_tokens * 2 * prices.active_parameters,
    }


def fleet_cost(
    hit_tokens: int, miss_tokens: int, output_tokens: int, store_gb_days: float, prices: Prices
) -> dict[str, Any]:
    """A fleet's bill: engine and store hits at the hit price, computed prompt tokens at the
    miss price, output, and the store's footprint at its price per GB-day."""
    tokens = token_bill(hit_tokens, miss_tokens, output_tokens, prices)
    store = store_gb_days * prices.store_per_gb_day
    return {
        "tokens_usd": round(tokens, 6),
        "store_gb_days": round(store_gb_days, 6),
        "store_usd": round(store, 6),
        "total_usd": round(tokens + store, 6),
    }
