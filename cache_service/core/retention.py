"""Retention classes (agent, chat, ...) and their TTLs."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from cache_service.core.lifetimes import Lifetimes
from cache_service.core.units import parse_duration

# agent and chat: how long the public report keeps prefixes. handoff: a prompt's partial last
# group, stored by a prefill engine for one decode engine (the vLLM connector's default
# `handoff_retention`), is read within seconds and of no use to any other request.
DEFAULT_RETENTION = {"agent": 3 * 86400.0, "chat": 7 * 86400.0, "handoff": 600.0}
DEFAULT_CLASS = "chat"

_CLASS_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")


def parse_retention_table(text: str) -> dict[str, float]:
    """Parse 'agent=3d,chat=7d,batch=2h' into class -> TTL seconds."""
    table: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, duration = item.partition("=")
        name = name.strip()
        if not sep or not _CLASS_NAME.match(name):
            raise ValueError(f"not a retention entry: {item!r} (use name=duration, e.g. chat=7d)")
        ttl = parse_duration(duration)
        if ttl <= 0:
            raise ValueError(f"retention {name!r} needs a positive TTL")
        table[name] = ttl
    if not table:
        raise ValueError("the retention table is empty")
    return table


@dataclass(frozen=True)
class RetentionPolicy:
    """The configured retention classes and the class used when a request names none."""

    ttl_seconds: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_RETENTION))
    default_class: str = DEFAULT_CLASS

    def __post_init__(self) -> None:
        if self.default_class not in self.ttl_seconds:
            raise ValueError(
                f"default retention class {self.default_class!r} is not in the table "
                f"({', '.join(sorted(self.ttl_seconds))})"
            )

    @property
    def classes(self) -> list[str]:
        """The class names, sorted."""
        return sorted(self.ttl_seconds)

    def lifetimes(self) -> Lifetimes:
        """The classes' TTLs as the store judges a block's expiry by them: what a store a cache
        with this policy works over is opened with (`lifetimes=`)."""
        return Lifetimes(dict(self.ttl_seconds))

    def resolve(self, name: str | None) -> tuple[str, float]:
        """The class a request gets and its TTL; KeyError for an unknown class."""
        chosen = self.default_class if name is None else name
        return chosen, self.ttl_seconds[chosen]


DEFAULT_LIFETIMES = RetentionPolicy().lifetimes()
"""What a store under a cache with the default retention classes is opened with."""
