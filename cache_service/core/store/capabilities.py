"""What each store backend does, declared once, by the backend.

Every store class carries a `Capabilities` value: the behaviours of `BEHAVIOURS` it lacks,
each with the reason. Start-up (which settings a store can honour), capacity enforcement
(whether to evict at all), the operator routes (which controls answer 501) and the contract
suite (which tests a backend must pass) all read it, so what a backend can do is written in
one place and never guessed at run time. The two facets a caller may use beyond the
`BlockStore` protocol are typed attributes of every store, None where a backend has none:
`disk` (a folder on a file system) and `remote` (a server whose failures are counted).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

# The behaviours not every backend has, and what having one means.
BEHAVIOURS: Mapping[str, str] = {
    "clock_expiry": "expiry follows the `now` each call is given",
    "store_eviction": "evict() picks victims (the store's capacity and eviction policy apply), "
    "and the store stays prefix-closed",
    "record_upkeep": "records are updated in place (use, hits, children, expiry, retention)",
    "exact_usage": "usage() counts blocks and payload bytes exactly, at once",
    "removal_log": "removals are remembered for inspect()",
    "tenant_bytes": "bytes are counted per tenant (tenant capacity quotas)",
    "subtree_removal": "removing a block (on request, or as damaged) removes its subtree",
    "purge_under": "a purge of the blocks under one prefix (POST /v1/purge with tokens)",
    "pins": "prefixes can be pinned: never evicted nor expired until unpinned (POST /v1/pin)",
    "disk": "the store lives in a folder on a file system whose room is watched (`disk`)",
    "remote": "the store is a server whose failures are counted as misses (`remote`)",
}


@dataclass(frozen=True)
class Capabilities:
    """A backend's declaration: its name for messages and the behaviours it lacks, why."""

    backend: str  # "LMDB", "memory", "Redis"
    lacks: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.lacks) - set(BEHAVIOURS))
        if unknown:
            raise ValueError(f"unknown behaviours {unknown}: not among {', '.join(BEHAVIOURS)}")

    def has(self, behaviour: str) -> bool:
        """Whether the backend has `behaviour` (one of BEHAVIOURS)."""
        if behaviour not in BEHAVIOURS:
            raise ValueError(f"{behaviour!r} is not one of {', '.join(BEHAVIOURS)}")
        return behaviour not in self.lacks

    def why_not(self, behaviour: str) -> str:
        """Why the backend lacks `behaviour` ("" when it has it)."""
        return "" if self.has(behaviour) else self.lacks[behaviour]

    def offered(self) -> list[str]:
        """The behaviours the backend has, in BEHAVIOURS' order."""
        return [name for name in BEHAVIOURS if name not in self.lacks]


@dataclass(frozen=True)
class OnDisk:
    """A store in a folder on a file system: what its room is measured with."""

    folder: Path
    file_bytes: Callable[[], int]  # the data file's size now
    # Why the store opened without updating its settings record (a full disk), if it did.
    unrecorded: Exception | None = None


class Remote(Protocol):
    """A store on a server: its failure counts and its own memory limit."""

    def health_counts(self) -> dict[str, int]:
        """What the server failed so far, by kind, for the metrics."""
        ...

    def memory_limit_bytes(self) -> int:
        """The server's own memory limit, which is the cache's capacity (0: none known)."""
        ...
