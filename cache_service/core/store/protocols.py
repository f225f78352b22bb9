"""What a store is: the protocols of its roles (reads, writes, eviction, pins and purges,
upkeep), `BlockStore` which is all of them, the types they answer with, and what each
backend declares it does.

Every store class carries a `Capabilities` value: the behaviours of `BEHAVIOURS` it lacks,
each with the reason. Start-up (which settings a store can honour), capacity enforcement
(whether to evict at all), the operator routes (which controls answer 501) and the contract
suite (which tests a backend must pass) all read it, so what a backend can do is written in
one place and never guessed at run time. The two facets a caller may use beyond the roles are
typed attributes of every store, None where a backend has none: `disk` (a folder on a file
system) and `remote` (a server whose failures are counted).

The LMDB and memory stores are a backend with the parts written once over it
(store/parts/composed.py); the Redis store implements the roles itself (store/redis/).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

from cache_service.core.blocks import (
    BlockKey,
    BlockState,
    ChainLink,
    Evicted,
    InsertResult,
    MatchResult,
    NamespaceId,
    NewBlock,
    PinLimits,
    PinRecord,
    PurgeResult,
    StoreKey,
    StoreUsage,
    Touch,
)
from cache_service.core.eviction import EvictionPolicy
from cache_service.core.lifetimes import Lifetimes

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
    "local_reads": "another process on the same host may read the store's files while it "
    "runs (`LmdbReader`: lookups with payloads, verified, never a write)",
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
    store_id: str = ""  # the store's own random id, made with it ("" if it has none)
    # Frees the reader slots of processes that died reading the files (their snapshots would
    # keep old pages from reuse); how many it freed.
    clear_stale_readers: Callable[[], int] = lambda: 0


class Remote(Protocol):
    """A store on a server: its failure counts and its own memory limit."""

    def health_counts(self) -> dict[str, int]:
        """What the server failed so far, by kind, for the metrics."""
        ...

    def memory_limit_bytes(self) -> int:
        """The server's own memory limit, which is the cache's capacity (0: none known)."""
        ...


class Space(Protocol):
    """A backend's capacity report: how it counts the space blocks take."""

    def estimate_bytes(self, payload_size: int, token_bytes: int) -> int:
        """The space one block of this size would take in this backend."""
        ...

    def reserved_bytes(self) -> int:
        """The space the backend takes before any block is counted (tables, headers)."""
        ...


class Dropped(NamedTuple):
    """What `drop_damaged` did: damaged records and payloads it found still damaged and
    removed, and every block it removed (those and the blocks under them, reason "corrupt")."""

    records: int = 0
    payloads: int = 0
    removed: tuple[Evicted, ...] = ()


class StoreReads(Protocol):
    """Reads: the longest verified prefix of a chain, and payloads."""

    def match(
        self,
        namespace: NamespaceId,
        links: Sequence[ChainLink],
        *,
        now: float,
        with_payloads: bool = False,
        sink: Callable[[int, bytes | memoryview | None], None] | None = None,
        known: tuple[int, bytes] | None = None,
    ) -> MatchResult:
        """Count the leading links that are stored, alive and verified (namespace, depth,
        parent and tokens). `known` = (n, incarnation): the first n links were verified before
        and block n-1 had that incarnation; if it still has, they are not read again."""
        ...

    def get_payloads(
        self, namespace: NamespaceId, keys: Sequence[BlockKey], *, now: float
    ) -> tuple[list[bytes | None], int]:
        """Payloads of alive blocks of one namespace (None where absent) and a corrupt count."""
        ...

    def read_payloads(
        self,
        namespace: NamespaceId,
        keys: Sequence[BlockKey],
        *,
        now: float,
        sink: Callable[[int, bytes | memoryview | None], None],
    ) -> int:
        """Hand each verified payload to `sink` as a view valid during the call (no copy);
        returns how many failed their checksum."""
        ...

    def usage(self) -> StoreUsage:
        """Blocks, payload bytes and the space the backend really uses."""
        ...


class StoreWrites(Protocol):
    """Writes: blocks stored under a stored parent, hits applied, calls grouped."""

    def insert(
        self,
        namespace: NamespaceId,
        blocks: Sequence[NewBlock],
        *,
        parent: ChainLink | None,
        now: float,
        retention: str,
        ttl_seconds: float,
    ) -> InsertResult:
        """Store consecutive blocks atomically; MissingParent if `parent` is not stored."""
        ...

    def touch(
        self,
        touches: Sequence[Touch],
        *,
        resolution_seconds: float = 0.0,
        slide_fraction: float = 0.0,
    ) -> None:
        """Apply verified hits: mark each hit's deepest block used and slide its prefix's
        expiry (uses within `resolution_seconds`, and slides of less than that or than
        `slide_fraction` of the TTL, are skipped)."""
        ...

    def batch(self) -> AbstractContextManager[None]:
        """Group this thread's calls into one transaction (all or nothing on LMDB)."""
        ...


class StoreEviction(Protocol):
    """Eviction: leaves removed down to a target, a tenant's own first, a subtree on
    request (a backend that evicts on its own declares it lacks `store_eviction`)."""

    def evict(
        self,
        *,
        now: float,
        max_blocks: int,
        target_used_bytes: int | None = None,
        target_blocks: int | None = None,
        expired_only: bool = False,
        protected: frozenset[StoreKey] = frozenset(),
    ) -> list[Evicted]:
        """Remove leaf blocks, expired first, then in policy order, until a target is met."""
        ...

    def tenant_bytes(self, partition: bytes) -> int:
        """A tenant's estimated bytes."""
        ...

    def evict_tenant(
        self,
        partition: bytes,
        *,
        target_bytes: int,
        now: float,
        max_blocks: int,
        protected: frozenset[StoreKey] = frozenset(),
    ) -> list[Evicted]:
        """Remove a tenant's own least recently used leaves down to `target_bytes`."""
        ...

    def remove_subtree(self, namespace: NamespaceId, key: BlockKey, *, now: float) -> list[Evicted]:
        """Remove block `key` and its stored descendants, deepest first (reason "removed");
        pinned blocks and their ancestors stay; an unknown key removes nothing."""
        ...


class StoreUpkeep(Protocol):
    """Upkeep: blocks reads found damaged dropped with their subtrees, and the close."""

    def drop_damaged(self, *, now: float, ttl_seconds: float) -> Dropped:
        """Remove the blocks reads found damaged (record or payload) with their subtrees
        (reason "corrupt"), mending the store around them; blocks a pin held above one
        expire `ttl_seconds` from now. Reads only note damage; this is the write."""
        ...

    def damage_pending(self) -> int:
        """How many damaged blocks reads noted since the last `drop_damaged`."""
        ...

    def close(self) -> None:
        """Release the backend's resources."""
        ...


class OperatorControls(Protocol):
    """What an operator may do to a store beyond the data path."""

    def pin(
        self,
        namespace: NamespaceId,
        links: Sequence[ChainLink],
        *,
        now: float,
        by: str,
        rank: int = 0,
        limits: PinLimits | None = None,
    ) -> tuple[PinRecord, bool]:
        """Pin a prefix from block 0: never evicted nor expired until unpinned."""
        ...

    def unpin(
        self,
        namespace: NamespaceId,
        deepest: BlockKey,
        *,
        now: float,
        ttl_seconds: float,
        rank: int = 0,
    ) -> int:
        """Release a pin (by its deepest block); how many blocks it held, 0 if none."""
        ...

    def pins(self, partition: bytes) -> list[PinRecord]:
        """A tenant's pins."""
        ...

    def links_of(
        self, namespace: NamespaceId, keys: Sequence[BlockKey], *, now: float
    ) -> list[ChainLink]:
        """The links of a stored prefix given by its keys; NotStored if it is not one."""
        ...

    def encoded_namespace(self, scope: StoreKey) -> bytes | None:
        """The encoded namespace stored for a scope (partition + root), if any."""
        ...

    def replace_namespace(self, scope: StoreKey, held: bytes, encoded: bytes) -> bool:
        """Replace a scope's stored namespace if it still is `held`; whether it was."""
        ...

    def purge(
        self,
        partition: bytes,
        *,
        root: BlockKey | None = None,
        under: StoreKey | None = None,
        now: float,
        ttl_seconds: float = 0.0,
    ) -> PurgeResult:
        """Delete a tenant's blocks, a namespace's, or those under one block (pins above it
        that lose their blocks let go, and what they held expires in `ttl_seconds`)."""
        ...

    def inspect(self, namespace: NamespaceId, link: ChainLink, *, now: float) -> BlockState:
        """Why one block of a chain, whose parent matched, does not match."""
        ...

    def first_block_homes(
        self, partition: bytes, token_bytes: bytes
    ) -> list[tuple[BlockKey, int, bytes | None]]:
        """(root, block size, encoded namespace) of first blocks that start like these."""
        ...


class BlockStore(StoreReads, StoreWrites, StoreEviction, OperatorControls, StoreUpkeep, Protocol):
    """A store of chained blocks that stays prefix-closed: a block's parent is always stored.

    The store never hashes: callers hand it chain links whose keys are already computed.
    """

    capabilities: Capabilities  # what the backend does (above)
    disk: OnDisk | None  # the folder and file it lives in, if on a file system
    remote: Remote | None  # the server it lives on, if any
    policy: EvictionPolicy  # which leaf goes first

    # Given when the store is opened, and kept while it is open.
    @property
    def removal_log_entries(self) -> int:
        """Recent removals remembered for explanations (0: none)."""
        ...

    @property
    def lifetimes(self) -> Lifetimes:
        """Each retention class's TTL, which bounds a block's expiry from now (see
        core.lifetimes); UNBOUNDED for a store opened without a table."""
        ...

    @property
    def space(self) -> Space:
        """The backend's capacity report (estimate_bytes, reserved_bytes)."""
        ...


class IdentityCheck(Protocol):
    """Judges a persistent store's record of the settings its data was made with (see
    `cache_service.core.identity`); the store only keeps the bytes, in the transaction that opens
    it, so that two processes opening a new store cannot both write a record."""

    def settle(self, stored: bytes | None, *, where: str) -> bytes:
        """The record to keep, given the one the store at `where` holds; raises to refuse."""
        ...
