"""Lifetimes: the longest a block of each retention class may still live, counted from now.

A wall clock may step back (NTP, a resumed VM). A block stored while it ran ahead then has an
expiry further away than its class's TTL: it is "from the future", and is read as a miss (the
sweeper removes it) so that no block is served past its class TTL counted from now. A store
is given the table when it is opened (`lifetimes=`, from `RetentionPolicy.lifetimes()`), and
keeps it while open; one opened without a table is UNBOUNDED, which judges a block by its
expiry alone. `PrefixCache` refuses a store whose table is not its own retention's. Stdlib
only (and core.units, which shows durations).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from cache_service.core.units import show_duration

SLACK_SECONDS = 1.0  # a tiny NTP step back does not turn fresh blocks into blocks from the future


@dataclass(frozen=True)
class Lifetimes:
    """Class name -> TTL seconds; a name not in the table (a class since removed from the
    configuration) is bounded by the longest TTL."""

    ttl_seconds: Mapping[str, float] = field(default_factory=dict)
    slack_seconds: float = SLACK_SECONDS
    longest_ttl_seconds: float = field(init=False, default=math.inf)
    bounds_by_name: Mapping[bytes, float] = field(init=False, default_factory=dict, repr=False)
    bounds_by_class: Mapping[str, float] = field(init=False, default_factory=dict, repr=False)
    shortest_bound: float = field(init=False, default=math.inf)
    longest_bound: float = field(init=False, default=math.inf)

    def __post_init__(self) -> None:
        longest = max(self.ttl_seconds.values(), default=math.inf)
        object.__setattr__(self, "longest_ttl_seconds", longest)
        # The hot paths look classes up by their stored bytes, and need no lookup at all for
        # an expiry within the shortest bound.
        bounds = {name.encode(): ttl + self.slack_seconds for name, ttl in self.ttl_seconds.items()}
        object.__setattr__(self, "bounds_by_name", bounds)
        by_class = {name: ttl + self.slack_seconds for name, ttl in self.ttl_seconds.items()}
        object.__setattr__(self, "bounds_by_class", by_class)
        object.__setattr__(self, "shortest_bound", min(bounds.values(), default=math.inf))
        object.__setattr__(self, "longest_bound", longest + self.slack_seconds)

    @property
    def longest_class(self) -> str:
        """The class with the longest TTL ("" for an empty table)."""
        return max(self.ttl_seconds, key=lambda name: self.ttl_seconds[name], default="")

    def describe(self) -> str:
        """'agent=3d, chat=7d' (as --retention takes it), or what an empty table means."""
        if not self.ttl_seconds:
            return "none (a block is judged by its expiry alone)"
        return show_retention_table(self.ttl_seconds, separator=", ")

    def ttl(self, retention: str) -> float:
        """A class's TTL (the longest for an unknown class)."""
        return self.ttl_seconds.get(retention, self.longest_ttl_seconds)

    def bound(self, retention: bytes) -> float:
        """How far from now a block of class `retention` (its stored bytes) may expire."""
        return self.bounds_by_name.get(retention, self.longest_bound)

    def alive(self, expires_at: float, retention: str, now: float) -> bool:
        """Alive: not expired, and pinned or expiring within its class's TTL from now."""
        if now >= expires_at:
            return False
        left = expires_at - now
        return (
            left <= self.shortest_bound
            or expires_at == math.inf
            or left <= self.bounds_by_class.get(retention, self.longest_bound)
        )

    def from_future(self, expires_at: float, retention: str, now: float) -> bool:
        """Stored while the clock ran ahead: a finite expiry beyond its class TTL from now."""
        return now < expires_at < math.inf and not self.alive(expires_at, retention, now)


def show_retention_table(table: Mapping[str, float], separator: str = ",") -> str:
    """'agent=3d,chat=7d': a table of class TTLs as --retention takes it."""
    return separator.join(f"{name}={show_duration(ttl)}" for name, ttl in table.items())


UNBOUNDED = Lifetimes()
"""No table: a block is judged by its expiry alone."""
