"""The BlockStore protocol: what the cache and its collaborators call on a store.

Every store is a backend (`store.backend`) with the parts written once over it
(`store.composed`); it speaks the data path below and the operator controls
(`store.controls.OperatorControls`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from cache_service.core.blocks import (
    BlockKey,
    ChainLink,
    Evicted,
    InsertResult,
    MatchResult,
    NamespaceId,
    NewBlock,
    StoreKey,
    StoreUsage,
    Touch,
)
from cache_service.core.eviction import EvictionPolicy
from cache_service.core.lifetimes import Lifetimes
from cache_service.core.store.backend import Space
from cache_service.core.store.capabilities import Capabilities, OnDisk, Remote
from cache_service.core.store.controls import OperatorControls
from cache_service.core.store.damage import Dropped


class BlockStore(OperatorControls, Protocol):
    """A store of chained blocks that stays prefix-closed: a block's parent is always stored.

    The store never hashes: callers hand it chain links whose keys are already computed.
    """

    capabilities: Capabilities  # what the backend does (store.capabilities)
    disk: OnDisk | None  # the folder and file it lives in, if on a file system
    remote: Remote | None  # the server it lives on, if any
    removal_log_entries: int  # recent removals remembered for explanations (0: none)
    policy: EvictionPolicy  # which leaf goes first
    lifetimes: Lifetimes  # each retention class's TTL: bounds a block's expiry from now

    @property
    def space(self) -> Space:
        """The backend's capacity report (estimate_bytes, reserved_bytes)."""
        ...

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

    def usage(self) -> StoreUsage:
        """Blocks, payload bytes and the space the backend really uses."""
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

    def drop_damaged(self, *, now: float, ttl_seconds: float) -> Dropped:
        """Remove the blocks reads found damaged (record or payload) with their subtrees
        (reason "corrupt"), mending the store around them; blocks a pin held above one
        expire `ttl_seconds` from now. Reads only note damage; this is the write."""
        ...

    def damage_pending(self) -> int:
        """How many damaged blocks reads noted since the last `drop_damaged`."""
        ...

    def batch(self) -> AbstractContextManager[None]:
        """Group this thread's calls into one transaction (all or nothing on LMDB)."""
        ...

    def close(self) -> None:
        """Release the backend's resources."""
        ...


class IdentityCheck(Protocol):
    """Judges a persistent store's record of the settings its data was made with (see
    `cache_service.core.identity`); the store only keeps the bytes, in the transaction that opens
    it, so that two processes opening a new store cannot both write a record."""

    def settle(self, stored: bytes | None, *, where: str) -> bytes:
        """The record to keep, given the one the store at `where` holds; raises to refuse."""
        ...
