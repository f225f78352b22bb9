"""What the cache saves: the bill at per-token prices, and the prefill compute not spent."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cache_service.tools.replay.stats import Tally

PER_MILLION = 1e6


@dataclass(frozen=True, slots=True)
class Prices:
    """Dollars per million tokens of each kind, and the model's active parameters."""

    hit_per_million: float = 0.003
    miss_per_million: float = 0.15
    output_per_million: float = 0.60
    active_parameters: float = 8e9


def cost_report(tally: Tally, prices: Prices) -> dict[str, Any]:
    """The bill with and without the cache, and the prefill FLOPs the hits saved."""
    output = tally.output_tokens * prices.output_per_million / PER_MILLION
    with_cache = (
        tally.hit_tokens * prices.hit_per_million + tally.miss_tokens * prices.miss_per_million
    ) / PER_MILLION + output
    without_cache = tally.prompt_tokens * prices.miss_per_million / PER_MILLION + output
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
