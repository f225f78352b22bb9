"""The data-path protocol a backend implements, in one module per backend (memory, LMDB).

A backend keeps five kinds of things, each by key, and changes them inside transactions:
- block records (`BlockMeta`) and payloads, by store key;
- encoded namespaces, by scope (partition + root);
- ordered indexes (`VICTIMS`, `EXPIRY`): entries of an 8-byte sort key then a store key,
  scanned in ascending order;
- small tables (`AUX_TABLES`): bytes by bytes key, scanned by key prefix;
- counters: the use sequence and the payload byte total.

Everything else (index upkeep, pins, removal logs, tenant bytes, eviction) is written once
over these, in the parts beside this module. `check`, `count_hits`, `lift_expiry` and
`incarnation` are a lookup's hot paths: a backend may read its raw records for them, or bind
the generic versions in `parts.generic` (all but `check`), written once over the rest.

A record that fails verification is never an error: every read of it (`get`, the hot paths,
`scan_blocks`) treats it as absent, adds its key to the transaction's `damaged` set and notes
it in the backend's `DamageLog`, from which `drop_damaged` removes it later.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from cache_service.core.blocks import BlockMeta, ChainLink, NamespaceId, StoreKey, StoreUsage
from cache_service.core.lifetimes import Lifetimes
from cache_service.core.store.parts.damage import DamageLog, Salvage
from cache_service.core.store.protocols import Space

# Where a read hands each payload: (index in the chain, the payload or None).
PayloadSink = Callable[[int, "bytes | memoryview | None"], None]

VICTIMS = "victims"  # leaf blocks, by eviction priority
EXPIRY = "expiry"  # every block, by expires_at
INDEXES = (VICTIMS, EXPIRY)
SORT_KEY_BYTES = 8  # an index entry is its 8-byte sort key then the block's stored key
# Small tables beside the blocks, each kept by one part:
PINS = "pins"  # a pin: namespace scope + its deepest block's hash -> what it pins
PIN_COUNTS = "pin_counts"  # stored key -> how many pins hold the block (u32)
REMOVALS = "removals"  # stored key -> why and when it was removed (bounded); the log counter
REMOVAL_ORDER = "removal_order"  # removal number -> stored key (to drop the oldest)
FIRSTS = "firsts"  # partition + first tokens' fingerprint + scope + block size -> b""
TENANT_LEAVES = "tenant_leaves"  # partition + victims sort key + stored key -> b""
TENANT_BYTES = "tenant_bytes"  # partition -> the tenant's estimated bytes (i64)
AUX_TABLES = (PINS, PIN_COUNTS, REMOVALS, REMOVAL_ORDER, FIRSTS, TENANT_LEAVES, TENANT_BYTES)


class Txn(Protocol):
    """One backend transaction: what every part of the store is written over."""

    damaged: set[StoreKey]  # keys whose records this transaction found damaged
    lifetimes: Lifetimes  # the backend's, given when it was opened (see core.lifetimes)

    def get(self, key: StoreKey) -> BlockMeta | None:
        """The block's record, or None: absent, or damaged (a copy: changing it changes
        nothing stored)."""
        ...

    def salvage(self, key: StoreKey) -> Salvage | None:
        """What can still be read of a record that fails verification; None when the record
        is absent or sound."""
        ...

    def put(self, meta: BlockMeta) -> None:
        """Write the block's record."""
        ...

    def delete(self, key: StoreKey) -> None:
        """Remove the block's record and payload."""
        ...

    def get_payload(self, key: StoreKey) -> bytes | memoryview | None:
        """The block's payload bytes, valid until the transaction ends."""
        ...

    def put_payload(self, key: StoreKey, payload: bytes | memoryview) -> None:
        """Write the block's payload bytes."""
        ...

    def get_namespace(self, scope: StoreKey) -> bytes | None:
        """The encoded namespace stored for a scope, or None."""
        ...

    def put_namespace(self, scope: StoreKey, encoded: bytes) -> None:
        """Record the encoded namespace of a scope."""
        ...

    def scan_blocks(self, prefix: bytes, after: bytes | None, limit: int) -> list[BlockMeta]:
        """Up to `limit` blocks whose stored key starts with `prefix` (a tenant's partition;
        b"" for the default tenant, whose keys have none), in key order after `after`."""
        ...

    def index_add(self, index: str, sort_key: bytes, key: StoreKey) -> None:
        """Add an entry to an ordered index."""
        ...

    def index_remove(self, index: str, sort_key: bytes, key: StoreKey) -> None:
        """Remove an entry from an ordered index (absent is fine)."""
        ...

    def index_scan(
        self, index: str, *, after: bytes | None, upto: bytes | None, limit: int
    ) -> Iterable[tuple[bytes, StoreKey]]:
        """Up to `limit` entries in ascending order, strictly after `after`, sort key <= `upto`."""
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

    def next_seq(self, count: int) -> int:
        """Reserve `count` use-sequence numbers and return the first."""
        ...

    def add_payload_bytes(self, delta: int) -> None:
        """Adjust the stored payload byte counter."""
        ...

    def usage(self) -> StoreUsage:
        """The store's size as this transaction sees it."""
        ...

    def latest_write(self) -> float:
        """The latest clock any stored expiry was counted from, as far as noted (a backend
        may keep it up to `Lifetimes.slack_seconds` coarse); -inf if none."""
        ...

    def note_write(self, at: float) -> None:
        """Note that an expiry was counted from clock `at`."""
        ...

    def judging(self, now: float) -> Lifetimes:
        """What bounds a block's expiry at `now`, the same on every path (lookup, fetch,
        insert, eviction): the class TTLs while a write is ahead of the clock (a block may
        be from the future), else nothing (every expiry stands as it was given)."""
        ...

    def set_latest_write(self, at: float) -> None:
        """Forget every noted write after `at` (the sweeper removed what they stored)."""
        ...

    # -- hot paths (see parts.generic for versions over get and put) ----------------------------

    def check(
        self, key: StoreKey, root_and_parent: bytes, tokens: bytes, depth: int, now: float
    ) -> int:
        """codec.MISSING, HIT or COLLISION for one block of a chain (`root_and_parent`:
        the namespace root then the parent key)."""
        ...

    def count_hits(
        self, namespace: NamespaceId, links: Sequence[ChainLink], start: int, now: float
    ) -> tuple[int, int]:
        """How many blocks of a chain from `start` `check` as HIT, and 1 if a COLLISION
        ended the run (else 0): the lookup's hot loop, in one call."""
        ...

    def read_hits(
        self,
        namespace: NamespaceId,
        links: Sequence[ChainLink],
        now: float,
        sink: PayloadSink,
        *,
        copied: bool,
        damage: DamageLog,
    ) -> tuple[int, int, int]:
        """`count_hits` from block 0 that also hands each hit's payload to `sink` once its
        length and checksum pass (a view valid during the call, or with `copied` bytes copied
        before the check); a payload that fails is noted in `damage` and ends the run.
        (matched, collisions, corrupt payloads)."""
        ...

    def lift_expiry(self, key: StoreKey, expires_at: float, retention: str) -> StoreKey | None:
        """Raise an inner block's expiry to `expires_at` under class `retention` (its index
        entries do not move); returns its parent's key to go on with, or None when it is
        absent, already lives as long, or is a root block."""
        ...

    def incarnation(self, key: StoreKey, now: float) -> bytes | None:
        """Bytes that change whenever the block is stored anew (its stored sequence), or
        None if it is absent or expired."""
        ...


class Backend(Protocol):
    """Where blocks live: transactions over them, a capacity report, and a close."""

    space: Space
    damage: DamageLog  # where its transactions note the damaged records they meet
    lifetimes: Lifetimes  # what bounds a block's expiry from now (given when opened)

    def read(self, *, views: bool = False) -> AbstractContextManager[Txn]:
        """A read transaction; with `views`, payload reads may return views into the store
        that stay valid until the transaction ends (no copy)."""
        ...

    def write(self) -> AbstractContextManager[Txn]:
        """A write transaction: committed when the block ends, undone if it raises."""
        ...

    def close(self) -> None:
        """Release the backend's resources."""
        ...
