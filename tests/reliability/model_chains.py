"""What the model-based cache tests share: prompts as chains of blocks, a clock that may jump
either way, and an events observer that collects evictions and refuses what must not happen.

A chain is the tuple of a prefix's blocks, each block a tuple of token ids: a model keyed by
chains shares no code with the package (which keys blocks by their hashes).
"""

from __future__ import annotations

from collections.abc import Sequence

from cache_service.core.blocks import Evicted
from cache_service.core.cache_observer import CacheObserver

Chain = tuple[tuple[int, ...], ...]


def flat(chain: Chain) -> list[int]:
    """The chain's tokens, in order."""
    return [token for block in chain for token in block]


def prefixes(chain: Chain) -> list[Chain]:
    """Every non-empty prefix of a chain, shortest first."""
    return [chain[: i + 1] for i in range(len(chain))]


class JumpClock:
    """A settable clock: calling it returns the current time in seconds; unlike
    tests/conftest.py's VirtualClock it may go back, as a wall clock stepped by NTP does."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move the time by `seconds` (negative: back) and return the new time."""
        self.now += seconds
        return self.now


class Recorder(CacheObserver):
    """A cache's events observer: collects evicted blocks; a collision, a corrupt payload or a
    conflicting payload fails the test (payloads are a function of the prefix, the hash is
    real and nothing damages the store)."""

    def __init__(self) -> None:
        super().__init__()
        self.evicted: list[Evicted] = []

    def on_lookup(
        self,
        *,
        retention: str,
        hit_tokens: int,
        miss_tokens: int,
        complete: bool,
        tenant: str = "",
    ) -> None:
        assert hit_tokens >= 0
        assert miss_tokens >= 0

    def on_insert(self, *, stored: int, refreshed: int, conflicts: int) -> None:
        assert conflicts == 0, "payloads are a function of the prefix: no conflict possible"

    def on_collision(self, count: int) -> None:
        raise AssertionError(f"{count} collisions with a real hash")

    def on_corrupt(self, count: int) -> None:
        raise AssertionError(f"{count} corrupt payloads in an undamaged store")

    def on_corrupt_records(self, count: int) -> None:
        raise AssertionError(f"{count} corrupt records in an undamaged store")

    def on_evicted(self, evicted: Sequence[Evicted], *, now: float) -> None:
        self.evicted.extend(evicted)

    def take(self) -> list[Evicted]:
        """The evictions reported since the last take, in order."""
        taken, self.evicted = self.evicted, []
        return taken
