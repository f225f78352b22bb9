"""The in-memory backend: plain dicts and sorted lists under one lock (the reference model)."""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace

from cache_service.core.blocks import KEY_BYTES, BlockMeta, StoreKey, StoreUsage
from cache_service.core.eviction import EvictionPolicy
from cache_service.core.lifetimes import UNBOUNDED, Lifetimes
from cache_service.core.store.parts import generic
from cache_service.core.store.parts.backend import AUX_TABLES, INDEXES, SORT_KEY_BYTES
from cache_service.core.store.parts.codec import COLLISION, HIT, MISSING, record_size
from cache_service.core.store.parts.composed import ComposedStore
from cache_service.core.store.parts.damage import DamageLog, Salvage
from cache_service.core.store.parts.removals import DEFAULT_REMOVAL_LOG_ENTRIES
from cache_service.core.store.protocols import Capabilities

# What a block costs beyond its payload and tokens here (dict slots, objects): an estimate,
# so that a byte capacity means roughly the same on this backend as on LMDB.
BLOCK_OVERHEAD_BYTES = 256


class MemorySpace:
    """The memory backend's capacity report: payload, record and a fixed overhead."""

    @staticmethod
    def estimate_bytes(payload_size: int, token_bytes: int) -> int:
        """The space one block takes here."""
        return payload_size + record_size(token_bytes) + BLOCK_OVERHEAD_BYTES

    @staticmethod
    def reserved_bytes() -> int:
        """Nothing is counted for an empty store."""
        return 0


class MemoryBackend:
    """Blocks in dicts, indexes in sorted lists; a transaction holds the one lock."""

    def __init__(self, *, lifetimes: Lifetimes = UNBOUNDED) -> None:
        self.space = MemorySpace()
        self.damage = DamageLog()  # records here are objects and never damaged; payloads may be
        self.metas: dict[StoreKey, BlockMeta] = {}
        self.payloads: dict[StoreKey, bytes] = {}
        self.namespaces: dict[StoreKey, bytes] = {}
        self.indexes: dict[str, list[bytes]] = {index: [] for index in INDEXES}
        self.aux: dict[str, dict[bytes, bytes]] = {table: {} for table in AUX_TABLES}
        self.seq = 1
        self.latest_write = -math.inf
        self.lifetimes = lifetimes
        self.payload_bytes = 0
        self.record_bytes = 0
        self._lock = threading.RLock()

    @contextmanager
    def read(self, *, views: bool = False) -> Iterator[_MemoryTxn]:
        """The lock, held while the transaction lives (changes are made in place)."""
        with self._lock:
            yield _MemoryTxn(self)

    write = read

    def close(self) -> None:
        """Nothing to release."""


class _MemoryTxn:
    """Direct access to the backend's structures; its lock is held while this lives."""

    def __init__(self, backend: MemoryBackend) -> None:
        self._b = backend
        self.damaged: set[StoreKey] = set()  # stays empty: a record object cannot be damaged
        self.lifetimes = backend.lifetimes

    count_hits = generic.count_hits
    read_hits = generic.read_hits
    lift_expiry = generic.lift_expiry
    incarnation = generic.incarnation

    def get(self, key: StoreKey) -> BlockMeta | None:
        meta = self._b.metas.get(key)
        return replace(meta) if meta is not None else None

    def salvage(self, key: StoreKey) -> Salvage | None:
        return None

    def check(
        self, key: StoreKey, root_and_parent: bytes, tokens: bytes, depth: int, now: float
    ) -> int:
        # Reads the record in place: `get` would copy it for every block of a lookup.
        meta = self._b.metas.get(key)
        if meta is None or not meta.is_alive(now, self.judging(now)):
            return MISSING
        same = (
            meta.namespace_root + meta.parent == root_and_parent
            and meta.depth == depth
            and meta.tokens == tokens
        )
        return HIT if same else COLLISION

    def put(self, meta: BlockMeta) -> None:
        old = self._b.metas.get(meta.key)
        if old is not None:
            self._b.record_bytes -= record_size(len(old.tokens))
        self._b.record_bytes += record_size(len(meta.tokens))
        self._b.metas[meta.key] = replace(meta)

    def delete(self, key: StoreKey) -> None:
        old = self._b.metas.pop(key, None)
        if old is not None:
            self._b.record_bytes -= record_size(len(old.tokens))
        self._b.payloads.pop(key, None)

    def get_payload(self, key: StoreKey) -> bytes | memoryview | None:
        return self._b.payloads.get(key)

    def put_payload(self, key: StoreKey, payload: bytes | memoryview) -> None:
        self._b.payloads[key] = bytes(payload)

    def get_namespace(self, scope: StoreKey) -> bytes | None:
        return self._b.namespaces.get(scope)

    def put_namespace(self, scope: StoreKey, encoded: bytes) -> None:
        self._b.namespaces[scope] = encoded

    def scan_blocks(self, prefix: bytes, after: bytes | None, limit: int) -> list[BlockMeta]:
        wanted = sorted(
            key
            for key in self._b.metas
            if key.startswith(prefix)
            and (prefix or len(key) == KEY_BYTES)
            and (after is None or key > after)
        )
        return [replace(self._b.metas[key]) for key in wanted[:limit]]

    def index_add(self, index: str, sort_key: bytes, key: StoreKey) -> None:
        bisect.insort(self._b.indexes[index], sort_key + key)

    def index_remove(self, index: str, sort_key: bytes, key: StoreKey) -> None:
        entries = self._b.indexes[index]
        entry = sort_key + key
        at = bisect.bisect_left(entries, entry)
        if at < len(entries) and entries[at] == entry:
            del entries[at]

    def index_scan(
        self, index: str, *, after: bytes | None, upto: bytes | None, limit: int
    ) -> Iterable[tuple[bytes, StoreKey]]:
        entries = self._b.indexes[index]
        at = bisect.bisect_right(entries, after) if after is not None else 0
        out: list[tuple[bytes, StoreKey]] = []
        for entry in entries[at : at + limit]:
            sort_key, key = entry[:SORT_KEY_BYTES], StoreKey(entry[SORT_KEY_BYTES:])
            if upto is not None and sort_key > upto:
                break
            out.append((sort_key, key))
        return out

    def aux_get(self, table: str, key: bytes) -> bytes | None:
        return self._b.aux[table].get(key)

    def aux_put(self, table: str, key: bytes, value: bytes) -> None:
        self._b.aux[table][key] = bytes(value)

    def aux_delete(self, table: str, key: bytes) -> None:
        self._b.aux[table].pop(key, None)

    def aux_scan(self, table: str, prefix: bytes, limit: int) -> list[tuple[bytes, bytes]]:
        entries = self._b.aux[table]
        keys = sorted(k for k in entries if k.startswith(prefix))[:limit]
        return [(k, entries[k]) for k in keys]

    def aux_count(self, table: str) -> int:
        return len(self._b.aux[table])

    def next_seq(self, count: int) -> int:
        first = self._b.seq
        self._b.seq += count
        return first

    def add_payload_bytes(self, delta: int) -> None:
        self._b.payload_bytes += delta

    def latest_write(self) -> float:
        return self._b.latest_write

    def note_write(self, at: float) -> None:
        self._b.latest_write = max(self._b.latest_write, at)

    def judging(self, now: float) -> Lifetimes:
        return self.lifetimes if self._b.latest_write > now else UNBOUNDED

    def set_latest_write(self, at: float) -> None:
        self._b.latest_write = at

    def usage(self) -> StoreUsage:
        blocks = len(self._b.metas)
        used = self._b.payload_bytes + self._b.record_bytes + BLOCK_OVERHEAD_BYTES * blocks
        return StoreUsage(blocks=blocks, payload_bytes=self._b.payload_bytes, used_bytes=used)


class MemoryStore(ComposedStore[MemoryBackend]):
    """A BlockStore in process memory: the reference model, and the store for quick tests."""

    capabilities = Capabilities(
        "memory",
        lacks={
            "disk": "the blocks live in this process's memory, gone when it exits",
            "remote": "no server: nothing between the cache and its blocks can fail",
            "local_reads": "the blocks live in this process's memory, which no other reads",
        },
    )

    def __init__(
        self,
        *,
        policy: EvictionPolicy | None = None,
        removal_log_entries: int = DEFAULT_REMOVAL_LOG_ENTRIES,
        lifetimes: Lifetimes = UNBOUNDED,
    ) -> None:
        super().__init__(
            MemoryBackend(lifetimes=lifetimes),
            policy=policy,
            removal_log_entries=removal_log_entries,
        )
