"""The subscriber's counters per engine, as plain numbers for metrics and /v1/stats.

Only the subscriber's thread writes them; readers take `snapshot()` copies (an int read is
atomic under the GIL, and a snapshot a few events old is fine for a metric).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields, replace


@dataclass(slots=True)
class EngineCounters:
    """What one engine's streams (all its ranks) have brought since the subscriber started."""

    batches: int = 0  # batches decoded and applied (live or replayed)
    events: int = 0  # events in them that we know (stores, removals, clears)
    unknown_events: int = 0  # events of tags we do not know, skipped
    malformed: int = 0  # messages skipped: bad framing, or a payload that is no batch
    malformed_events: int = 0  # events skipped inside otherwise sound batches
    duplicates: int = 0  # batches already applied (replay overlapping the live stream)
    gaps: int = 0  # times sequence numbers were missing mid-stream
    replays: int = 0  # replay requests sent
    replayed_batches: int = 0  # batches applied from replay
    replay_failures: int = 0  # replays that timed out before their end marker
    restarts: int = 0  # publisher restarts detected (the rank's view rebuilt)
    downs: int = 0  # times a rank went down (disconnected, or silent past the timeout)
    stale_ranks: int = 0  # ranks whose view may miss events now (a gauge)
    dropped_entries: int = 0  # view entries dropped by the memory bound
    verified: int = 0  # stored events whose hashes the configured scheme reproduced
    mismatches: int = 0  # stored events whose hashes it did not reproduce
    verify_errors: int = 0  # the verify hook raised

    def snapshot(self) -> EngineCounters:
        """A copy, safe to read while the subscriber goes on."""
        return replace(self)

    @property
    def stale(self) -> bool:
        """Whether any rank's view may miss events."""
        return self.stale_ranks > 0


def total(counters: Iterable[EngineCounters]) -> EngineCounters:
    """The sum over engines (stale_ranks sums too: the number of stale ranks)."""
    result = EngineCounters()
    for item in counters:
        for field in fields(EngineCounters):
            setattr(result, field.name, getattr(result, field.name) + getattr(item, field.name))
    return result
