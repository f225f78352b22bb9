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
NO_HISTORY = "connected, but its replay socket did not answer"


@dataclass(frozen=True, slots=True)
class Down:
    """Since when a rank is down and why: replaced whole, so a reader never sees half."""

    since: float  # wall clock, for people
    since_monotonic: float  # for the grace: a clock step neither keeps nor drops an engine
    reason: str

    @classmethod
    def now(cls, reason: str) -> Down:
        """Down from this moment."""
        return cls(time.time(), time.monotonic(), reason)


@dataclass(slots=True)
class RankLiveness:
    """One rank's connection and the last time it was heard from."""

    connected: bool = False
    ever_connected: bool = False
    heard_at: float = 0.0  # time.monotonic() of the last message or replay answer
    down: Down | None = field(default_factory=lambda: Down.now(NOT_CONNECTED))  # None: up

    @property
    def up(self) -> bool:
        """Whether the rank is up."""
        return self.down is None

    def come_up(self, now: float) -> bool:
        """Heard from it (at monotonic `now`); True if it was down."""
        self.heard_at = now
        was_down, self.down = self.down is not None, None
        return was_down

    def go_down(self, reason: str) -> bool:
        """It disconnected or fell silent; True if it was up."""
        down = self.down
        if down is None or down.reason in (NOT_CONNECTED, NO_HISTORY):
            self.down = Down.now(reason)
        return down is None

    def note(self, reason: str) -> None:
        """A better reason for a rank still down (its time unchanged)."""
        down = self.down
        if down is not None:
            self.down = Down(down.since, down.since_monotonic, reason)


@dataclass(frozen=True, slots=True)
class EngineLiveness:
    """An engine as routing sees it: live, or down since when and why."""

    live: bool
    down: Down | None = None  # when its last rank went down

    @property
    def down_since(self) -> float | None:
        """Wall-clock time it went down (None when live)."""
        return None if self.down is None else self.down.since

    @property
    def reason(self) -> str | None:
        """Why it is down (None when live)."""
        return None if self.down is None else self.down.reason

    def down_for(self, now_monotonic: float) -> float:
        """Seconds it has been down at `time.monotonic()` = `now_monotonic` (0 when live)."""
        if self.down is None:
            return 0.0
        return max(0.0, now_monotonic - self.down.since_monotonic)


def engine_liveness(ranks: Sequence[RankLiveness]) -> EngineLiveness:
    """Live while any rank is up; else down since its last rank went down."""
    downs = [rank.down for rank in ranks]  # each read once: the subscriber may replace it
    if not downs or any(down is None for down in downs):
        return EngineLiveness(True)
    latest = max((down for down in downs if down is not None), key=lambda d: d.since_monotonic)
    return EngineLiveness(False, latest)
