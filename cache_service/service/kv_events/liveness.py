"""Whether an engine's publisher is still there: connected, and heard from lately.

A rank is *up* from its first connection (or, after it went down, from the next message it
sends: a live batch or a replay answer) until its connection drops (ZMQ's socket monitor
reports the disconnect; the SUB's ZMTP heartbeats turn a host that vanished without closing
its sockets into one) or, when a silence timeout is set, until nothing came for that long.
An engine is live while any of its ranks is up; once every rank is down it is ranked after
live engines in routing answers, and left out of them after the grace. Its view is kept:
an engine that comes back resumes with it (a restart rebuilds it, as always).

Only the subscriber's thread writes these; readers take `engine_liveness` snapshots.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

NOT_CONNECTED = "not connected yet"
DISCONNECTED = "disconnected"
SILENT = "silent"


@dataclass(slots=True)
class RankLiveness:
    """One rank's connection and the last time it was heard from."""

    up: bool = False
    connected: bool = False
    ever_connected: bool = False
    heard_at: float = 0.0  # time.monotonic() of the last message or replay answer
    down_since: float | None = field(default_factory=time.time)  # wall clock, None when up
    down_reason: str | None = NOT_CONNECTED

    def come_up(self, now: float) -> bool:
        """Heard from it (at monotonic `now`); True if it was down."""
        self.heard_at = now
        was_down = not self.up
        self.up, self.down_since, self.down_reason = True, None, None
        return was_down

    def go_down(self, reason: str) -> bool:
        """It disconnected or fell silent; True if it was up."""
        was_up = self.up
        if was_up or self.down_reason == NOT_CONNECTED:
            self.up, self.down_since, self.down_reason = False, time.time(), reason
        return was_up


@dataclass(frozen=True, slots=True)
class EngineLiveness:
    """An engine as routing sees it: live, or down since when and why."""

    live: bool
    down_since: float | None = None  # wall clock: when its last rank went down
    reason: str | None = None

    def down_for(self, now: float) -> float:
        """Seconds it has been down at wall-clock `now` (0 when live)."""
        return 0.0 if self.down_since is None else max(0.0, now - self.down_since)


def engine_liveness(ranks: Sequence[RankLiveness]) -> EngineLiveness:
    """Live while any rank is up; else down since its last rank went down."""
    if any(rank.up for rank in ranks):
        return EngineLiveness(True)
    downs = [rank for rank in ranks if rank.down_since is not None]
    if not downs:
        return EngineLiveness(True)  # no rank at all: nothing to say it went away
    latest = max(downs, key=lambda rank: rank.down_since or 0.0)
    return EngineLiveness(False, latest.down_since, latest.down_reason)
