"""A fleet replay's accounting: prompt tokens by tier (engine cache, store, computed), in
total, per engine, per request and over time, and the store's footprint over time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cache_service.tools.replay.fleet import TierHits
from cache_service.tools.replay.stats import window_series
from cache_service.tools.replay.traces import TraceRequest


def _share(part: int, whole: int) -> float:
    return round(part / whole, 6) if whole else 0.0


@dataclass(slots=True)
class TierTally:
    """Prompt tokens by where they came from, over some requests."""

    requests: int = 0
    prompt_tokens: int = 0
    engine_tokens: int = 0
    store_tokens: int = 0
    output_tokens: int = 0

    def add(self, request: TraceRequest, tiers: TierHits) -> None:
        """Count one request."""
        self.requests += 1
        self.prompt_tokens += tiers.prompt_tokens
        self.engine_tokens += tiers.engine_tokens
        self.store_tokens += tiers.store_tokens
        self.output_tokens += request.output_length

    @property
    def miss_tokens(self) -> int:
        """Prompt tokens computed."""
        return self.prompt_tokens - self.engine_tokens - self.store_tokens

    def as_dict(self) -> dict[str, Any]:
        """The figures a report shows, with each tier's share of the prompt tokens."""
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "engine_tokens": self.engine_tokens,
            "store_tokens": self.store_tokens,
            "miss_tokens": self.miss_tokens,
            "output_tokens": self.output_tokens,
            "engine_share": _share(self.engine_tokens, self.prompt_tokens),
            "store_share": _share(self.store_tokens, self.prompt_tokens),
            "miss_share": _share(self.miss_tokens, self.prompt_tokens),
        }


@dataclass
class FleetStats:
    """One fleet run's tallies."""

    engines: int
    window_seconds: float
    total: TierTally = field(default_factory=TierTally)
    windows: dict[int, TierTally] = field(default_factory=dict)
    by_engine: list[TierTally] = field(init=False)
    # Per request, in replay order: the engine, and its tokens from the engine and the store.
    per_request: dict[str, list[int]] = field(
        default_factory=lambda: {"engine": [], "engine_tokens": [], "store_tokens": []}
    )
    held_token_seconds: float = 0.0  # the store's blocks held, integrated over trace time
    _last_held: tuple[float, int] | None = None

    def __post_init__(self) -> None:
        self.by_engine = [TierTally() for _ in range(self.engines)]

    def add(self, request: TraceRequest, tiers: TierHits) -> None:
        """Count one request everywhere it belongs."""
        self.total.add(request, tiers)
        self.by_engine[tiers.engine].add(request, tiers)
        window = int(request.timestamp // self.window_seconds)
        self.windows.setdefault(window, TierTally()).add(request, tiers)
        self.per_request["engine"].append(tiers.engine)
        self.per_request["engine_tokens"].append(tiers.engine_tokens)
        self.per_request["store_tokens"].append(tiers.store_tokens)
        if self._last_held is not None:
            since, held = self._last_held
            self.held_token_seconds += held * (request.timestamp - since)
        self._last_held = (request.timestamp, tiers.store_tokens_held)

    def store_gb_days(self, kv_bytes_per_token: int) -> float:
        """The store's footprint over the trace: GB (10^9 bytes) held x days."""
        return self.held_token_seconds * kv_bytes_per_token / 1e9 / 86_400

    def window_points(self) -> list[dict[str, Any]]:
        """Per window, in time order (empty windows included, so plots show gaps)."""
        return window_series(self.windows, self.window_seconds, TierTally)
