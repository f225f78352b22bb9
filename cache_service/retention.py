"""Retention classes (agent, chat, ...) and their TTLs, with parsers for sizes and durations."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

DEFAULT_RETENTION = {"agent": 3 * 86400.0, "chat": 7 * 86400.0}
DEFAULT_CLASS = "chat"

_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_CLASS_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")


def parse_duration(text: str) -> float:
    """Parse '3d', '2h', '30m', '45s' or a plain number of seconds."""
    found = _NUMBER_UNIT.match(text)
    unit = found.group(2).lower() if found else ""
    if not found or unit not in _DURATION_UNITS:
        raise ValueError(f"not a duration: {text!r} (use e.g. 45s, 30m, 2h, 3d)")
    return float(found.group(1)) * _DURATION_UNITS[unit]


def parse_size(text: str) -> int:
    """Parse '20GiB', '512MB', '4096' (bytes) into bytes."""
    found = _NUMBER_UNIT.match(text)
    unit = found.group(2).lower() if found else ""
    if not found or unit not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 512MiB, 20GiB, 10GB)")
    return int(float(found.group(1)) * _SIZE_UNITS[unit])


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

    def resolve(self, name: str | None) -> tuple[str, float]:
        """The class a request gets and its TTL; KeyError for an unknown class."""
        chosen = self.default_class if name is None else name
        return chosen, self.ttl_seconds[chosen]
