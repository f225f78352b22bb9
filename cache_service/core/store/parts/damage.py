"""Blocks found damaged as they were read, waiting to be dropped with their subtrees.

Reads never write (a lookup holds no write transaction), so a block whose record fails its
checksum, or whose payload fails its own, is read as a miss and its key noted here; a later
write (`drop_damaged`: the server's touch flush, or at once in a replay) removes it and every
block under it. The log belongs to the backend, so every path that reads a record notes what
it finds (lookups, fetches, inserts, touches, eviction scans, pins, explanations), and a key
is noted once however often it is read before the drop.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import NamedTuple

from cache_service.core.blocks import StoreKey

MAX_NOTED_KEYS = 100_000  # past this, keys are forgotten: read again, they are noted again


class Noted(NamedTuple):
    """Keys taken from the log: damaged records, and payloads that failed their checksum."""

    records: frozenset[StoreKey]
    payloads: frozenset[StoreKey]


class DamageLog:
    """Thread-safe sets of damaged keys, bounded."""

    def __init__(self) -> None:
        self._records: set[StoreKey] = set()
        self._payloads: set[StoreKey] = set()
        self._lock = threading.Lock()

    def note_record(self, key: StoreKey) -> None:
        """A record under `key` failed verification."""
        with self._lock:
            if len(self._records) < MAX_NOTED_KEYS:
                self._records.add(key)

    def note_payload(self, key: StoreKey) -> None:
        """The payload under `key` failed its checksum (its record is sound)."""
        with self._lock:
            if len(self._payloads) < MAX_NOTED_KEYS:
                self._payloads.add(key)

    def take(self) -> Noted:
        """Every noted key, leaving the log empty."""
        with self._lock:
            records, self._records = frozenset(self._records), set()
            payloads, self._payloads = frozenset(self._payloads), set()
        return Noted(records, payloads)

    def forget(self, keys: Iterable[StoreKey]) -> None:
        """Drop keys that are dealt with (the drop itself reads them again, and notes them)."""
        with self._lock:
            self._records.difference_update(keys)
            self._payloads.difference_update(keys)

    def give_back(self, records: Iterable[StoreKey], payloads: Iterable[StoreKey]) -> None:
        """Note keys again (a drop that failed keeps them for the next one)."""
        for key in records:
            self.note_record(key)
        for key in payloads:
            self.note_payload(key)

    @property
    def pending(self) -> int:
        """How many keys wait for a drop."""
        return len(self._records) + len(self._payloads)


class Salvage(NamedTuple):
    """What is left to read of a damaged record, none of it trusted: enough to delete it,
    estimate what it took, and guess its parent."""

    record_bytes: int
    payload_bytes: int  # the stored payload's length (0: none)
    parent: bytes  # the parent key the record names, perhaps itself damaged
