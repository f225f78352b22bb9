"""The BlockStore protocol every backend implements, and the primitives it is built from."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from cache_service.blocks import (
    BlockKey,
    BlockMeta,
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
    StoreUsage,
    Touch,
)

VICTIMS = "victims"  # leaf blocks, by eviction priority
EXPIRY = "expiry"  # every block, by expires_at
SORT_KEY_BYTES = 8  # an index entry is its 8-byte sort key then the block's stored key
# Small tables beside the blocks, for the operator controls (see store.controls):
PINS = "pins"  # a pin: namespace scope + its deepest block's hash -> what it pins
PIN_COUNTS = "pin_counts"  # stored key -> how many pins hold the block (u32)
REMOVALS = "removals"  # stored key -> why and when the block was removed (bounded)
REMOVAL_ORDER = "removal_order"  # removal sequence -> stored key (to drop the oldest)
FIRSTS = "firsts"  # partition + first tokens' fingerprint + scope + block size -> b""
TENANT_LEAVES = "tenant_leaves"  # partition + victims sort key + stored key -> b""
TENANT_BYTES = "tenant_bytes"  # partition -> the tenant's estimated bytes (i64)
AUX_TABLES = (PINS, PIN_COUNTS, REMOVALS, REMOVAL_ORDER, FIRSTS, TENANT_LEAVES, TENANT_BYTES)


class BlockStore(Protocol):
    """A store of chained blocks that stays prefix-closed: a block's parent is always stored.

    The store never hashes: callers hand it chain links whose keys are already computed.
    """

    removal_log_entries: int  # recent removals remembered for explanations (0: none)

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
        protected: frozenset[BlockKey] = frozenset(),
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
        protected: frozenset[BlockKey] = frozenset(),
    ) -> list[Evicted]:
        """Remove a tenant's own least recently used leaves down to `target_bytes`."""
        ...

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

    def encoded_namespace(self, scope: BlockKey) -> bytes | None:
        """The encoded namespace stored for a scope (partition + root), if any."""
        ...

    def purge(
        self,
        partition: bytes,
        *,
        root: BlockKey | None = None,
        under: BlockKey | None = None,
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

    def batch(self) -> AbstractContextManager[None]:
        """Group this thread's calls into one transaction (all or nothing)."""
        ...

    def estimate_bytes(self, payload_size: int, token_bytes: int) -> int:
        """The space one block of this size would take in this backend."""
        ...

    def reserved_bytes(self) -> int:
        """The space the backend takes before any block is counted (tables, headers)."""
        ...

    def close(self) -> None:
        """Release the backend's resources."""
        ...


class IdentityCheck(Protocol):
    """Judges a persistent store's record of the settings its data was made with (see
    `cache_service.identity`); the store only keeps the bytes, in the transaction that opens
    it, so that two processes opening a new store cannot both write a record."""

    def settle(self, stored: bytes | None, *, where: str) -> bytes:
        """The record to keep, given the one the store at `where` holds; raises to refuse."""
        ...


class BlockTxn(Protocol):
    """The primitive operations of one backend transaction (see `store.ops`)."""

    def get(self, key: BlockKey) -> BlockMeta | None:
        """The block's metadata, or None."""
        ...

    def check(
        self, key: BlockKey, root_and_parent: bytes, tokens: bytes, depth: int, now: float
    ) -> int:
        """codec.MISSING, HIT or COLLISION for one block of a chain, as cheaply as the
        backend can tell (`root_and_parent`: the namespace root then the parent key)."""
        ...

    def count_hits(
        self, namespace: NamespaceId, links: Sequence[ChainLink], start: int, now: float
    ) -> tuple[int, int]:
        """How many blocks of a chain of `namespace` from `start` `check` as HIT, and 1 if
        a COLLISION ended the run (else 0): the lookup's hot loop, in one call."""
        ...

    def lift_expiry(self, key: BlockKey, expires_at: float, retention: str) -> BlockKey | None:
        """Raise an inner block's expiry to `expires_at` under class `retention` (its victims
        entry does not move: it has children); returns its parent's key to go on with, or
        None when it is absent, already lives as long, or is a root block."""
        ...

    def incarnation(self, key: BlockKey, now: float) -> bytes | None:
        """Bytes that change whenever the block is stored anew (its stored sequence), or
        None if it is absent or expired."""
        ...

    def put(self, meta: BlockMeta) -> None:
        """Write the block's metadata."""
        ...

    def delete(self, key: BlockKey) -> None:
        """Remove the block's metadata and payload."""
        ...

    def get_payload(self, key: BlockKey) -> bytes | memoryview | None:
        """The block's payload bytes, valid until the transaction ends."""
        ...

    def get_namespace(self, root: BlockKey) -> bytes | None:
        """The encoded namespace stored for a root key, or None."""
        ...

    def put_namespace(self, root: BlockKey, encoded: bytes) -> None:
        """Record the encoded namespace of a root key."""
        ...

    def put_payload(self, key: BlockKey, payload: bytes | memoryview) -> None:
        """Write the block's payload bytes."""
        ...

    def index_add(self, index: str, sort_key: bytes, key: BlockKey) -> None:
        """Add an entry to an ordered index."""
        ...

    def index_remove(self, index: str, sort_key: bytes, key: BlockKey) -> None:
        """Remove an entry from an ordered index."""
        ...

    def index_scan(
        self, index: str, *, after: bytes | None, upto: bytes | None, limit: int
    ) -> Iterable[tuple[bytes, BlockKey]]:
        """Up to `limit` entries in ascending order, strictly after `after`, sort key <= `upto`."""
        ...

    def next_seq(self, count: int) -> int:
        """Reserve `count` use-sequence numbers and return the first."""
        ...

    def aux_get(self, table: str, key: bytes) -> bytes | None:
        """A value of one of the AUX_TABLES, or None."""
        ...

    def aux_put(self, table: str, key: bytes, value: bytes) -> None:
        """Write a value of one of the AUX_TABLES."""
        ...

    def aux_delete(self, table: str, key: bytes) -> None:
        """Remove a key of one of the AUX_TABLES (absent is fine)."""
        ...

    def aux_scan(self, table: str, prefix: bytes, limit: int) -> list[tuple[bytes, bytes]]:
        """Up to `limit` (key, value) pairs whose key starts with `prefix`, in key order."""
        ...

    def aux_count(self, table: str) -> int:
        """How many keys one of the AUX_TABLES holds."""
        ...

    def scan_blocks(self, prefix: bytes, after: bytes | None, limit: int) -> list[BlockMeta]:
        """Up to `limit` blocks whose stored key starts with `prefix` (a tenant's partition;
        b"" for the default tenant, whose keys have none), in key order after `after`."""
        ...

    def add_payload_bytes(self, delta: int) -> None:
        """Adjust the stored payload byte counter."""
        ...

    def usage(self) -> StoreUsage:
        """The store's size as this transaction sees it."""
        ...
