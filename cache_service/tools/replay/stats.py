"""Hit and miss accounting of a replay: totals, by retention class, by tenant, over time."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from cache_service.tools.replay.traces import TraceRequest


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the cache gave one request, in the trace's units."""

    request: TraceRequest
    blocks: int  # cacheable trace blocks
    hit_blocks: int  # prefix-matched trace blocks
    hit_tokens: int  # min(hit blocks x block tokens, input_length)


@dataclass(slots=True)
class Tally:
    """Running totals over some requests."""

    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    output_tokens: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    requests_with_hit: int = 0

    def add(self, outcome: Outcome) -> None:
        """Count one request."""
        self.requests += 1
        self.prompt_tokens += outcome.request.input_length
        self.hit_tokens += outcome.hit_tokens
        self.output_tokens += outcome.request.output_length
        self.blocks += outcome.blocks
        self.hit_blocks += outcome.hit_blocks
        self.requests_with_hit += outcome.hit_blocks > 0

    @property
    def miss_tokens(self) -> int:
        """Prompt tokens that missed."""
        return self.prompt_tokens - self.hit_tokens

    @property
    def token_hit_ratio(self) -> float:
        """Hit tokens / prompt tokens."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def block_hit_ratio(self) -> float:
        """Prefix-matched blocks / blocks, summed over requests."""
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The figures the report shows."""
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "miss_tokens": self.miss_tokens,
            "output_tokens": self.output_tokens,
            "token_hit_ratio": round(self.token_hit_ratio, 6),
            "block_hit_ratio": round(self.block_hit_ratio, 6),
            "requests_with_hit": self.requests_with_hit,
            "blocks": self.blocks,
            "hit_blocks": self.hit_blocks,
        }


@dataclass
class ReplayStats:
    """Totals of a replay, broken down by retention class, tenant and time window."""

    window_seconds: float
    total: Tally = field(default_factory=Tally)
    by_retention: dict[str, Tally] = field(default_factory=dict)
    by_tenant: dict[str, Tally] = field(default_factory=dict)
    windows: dict[int, Tally] = field(default_factory=dict)

    def add(self, outcome: Outcome, *, retention: str) -> None:
        """Count one request everywhere it belongs."""
        self.total.add(outcome)
        self.by_retention.setdefault(retention, Tally()).add(outcome)
        self.by_tenant.setdefault(outcome.request.tenant, Tally()).add(outcome)
        window = int(outcome.request.timestamp // self.window_seconds)
        self.windows.setdefault(window, Tally()).add(outcome)

    def window_points(self) -> list[dict[str, Any]]:
        """Per window, in time order (empty windows included, so plots show gaps)."""
        return window_series(self.windows, self.window_seconds, Tally)


class Figures(Protocol):
    """A tally a report shows."""

    def as_dict(self) -> dict[str, Any]:
        """Its figures."""
        ...


def window_series(
    windows: Mapping[int, Figures], width: float, empty: Callable[[], Figures]
) -> list[dict[str, Any]]:
    """Each window's figures from the first to the last in time order, with its start;
    windows without requests shown as `empty()`, so that plots show the gaps."""
    if not windows:
        return []
    return [
        {"start_seconds": index * width, **windows.get(index, empty()).as_dict()}
        for index in range(min(windows), max(windows) + 1)
    ]
