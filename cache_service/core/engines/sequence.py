"""Sequence numbers of one publisher's stream: in order, duplicate, gap, or restart.

vLLM's and SGLang's publishers number batches 0, 1, 2, ... per process (per data-parallel
rank) and keep the last N in a replay buffer. One PUB socket delivers its messages in order,
so on the live stream a number never goes back, except when the publisher restarted and
counts from 0 again. Numbers at or below the last one applied arrive only through replay
overlapping the live stream: those are duplicates.

A restart is: the number 0 after any other; a number far below the last seen (more than
`duplicate_window`); or any backward step after the connection was re-established
(`note_reconnect`), since a slow joiner can miss a restarted publisher's first messages.

The missing range of a gap is for replay; what a restart or the first message missed (the
publisher's history before we joined) can be replayed too but never makes a view stale:
missing those only under-reports, while a gap mid-stream can hide removals.

A subscriber that asks for the publisher's history as soon as it connects (`on_history`)
may then read the same numbers live, published while the replay ran: up to the last
number the history held they are duplicates, even 0, which is otherwise a restart.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

DEFAULT_DUPLICATE_WINDOW = 1024
# Messages the old publisher may still have queued after a reconnect: for this many forward
# steps a backward one is still taken as the restart the reconnect announced.
RECONNECT_WINDOW = 64


class Verdict(enum.Enum):
    """What one sequence number means for the view."""

    FIRST = "first"  # the first message seen: start here (history is `missing`)
    IN_ORDER = "in_order"  # the next one: apply it
    DUPLICATE = "duplicate"  # already applied: skip it
    GAP = "gap"  # numbers are missing before it (`missing`)
    RESTART = "restart"  # the publisher started over: rebuild the view from this stream


@dataclass(frozen=True, slots=True)
class Decision:
    """A verdict and, for FIRST, GAP and RESTART, the numbers missed before this one."""

    verdict: Verdict
    seq: int
    missing: range = range(0)


class SequenceTracker:
    """The sequence state of one (engine, rank) stream.

    Live messages go through `on_live`; after a FIRST, GAP or RESTART the caller replays what
    it can of `missing` through `on_replayed`, then passes the live message itself to
    `on_replayed` too, which applies it, skips it as a duplicate, or reports the gap left.
    """

    def __init__(self, *, duplicate_window: int = DEFAULT_DUPLICATE_WINDOW) -> None:
        self.duplicate_window = duplicate_window
        self.last_live: int | None = None
        self.last_applied: int | None = None  # None: nothing applied in this incarnation
        self._reconnect_window = 0  # forward steps left in which a step back is a restart
        self._history_through = -1  # the last number `on_history` applied

    def note_reconnect(self) -> None:
        """The connection to the publisher was re-established (it may have restarted)."""
        self._reconnect_window = RECONNECT_WINDOW

    def note_same_publisher(self) -> None:
        """The reconnected publisher proved to be the one before (no restart to expect)."""
        self._reconnect_window = 0

    def start_over(self) -> None:
        """Forget every number: the publisher restarted and its history comes next."""
        self.last_live = self.last_applied = None
        self._reconnect_window = 0
        self._history_through = -1

    def on_history(self, seq: int) -> Decision:
        """Classify a number of the history asked for at connection (as `on_replayed`);
        the live stream then resumes after it."""
        decision = self.on_replayed(seq)
        if self.last_live is None or seq > self.last_live:
            self.last_live = seq
        self._history_through = max(self._history_through, seq)
        return decision

    def on_live(self, seq: int) -> Decision:
        """Classify a number read from the live stream."""
        last_live, reconnected = self.last_live, self._reconnect_window > 0
        if last_live is None or seq > last_live:
            # The old publisher's queued messages may come first: the window stays open.
            self._reconnect_window = max(0, self._reconnect_window - 1)
            self.last_live = seq
            if seq > self._history_through:
                self._history_through = -1  # past the history: a step back is a restart again
            if last_live is None:
                self.last_applied = None
                return Decision(Verdict.FIRST, seq, range(0, seq))
            return self._classify(seq)
        self._reconnect_window = 0
        if not reconnected and seq <= self._history_through:
            return self._classify(seq)  # published while the history was replayed
        if reconnected or seq == 0 or last_live - seq > self.duplicate_window:
            self.last_live, self.last_applied = seq, None
            self._history_through = -1
            return Decision(Verdict.RESTART, seq, range(0, seq))
        return self._classify(seq)  # a duplicate the live stream repeated

    def on_replayed(self, seq: int) -> Decision:
        """Classify a replayed number (or the live one held while replaying); a gap left
        here is accepted: the number becomes the last applied."""
        decision = self._classify(seq)
        if decision.verdict is Verdict.GAP:
            self.last_applied = seq
        return decision

    def _classify(self, seq: int) -> Decision:
        last = self.last_applied
        if last is None or seq == last + 1:
            self.last_applied = seq
            return Decision(Verdict.IN_ORDER, seq)
        if seq <= last:
            return Decision(Verdict.DUPLICATE, seq)
        return Decision(Verdict.GAP, seq, range(last + 1, seq))
