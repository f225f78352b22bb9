"""The in-memory reference store: plain dicts and sorted lists under one lock."""

from __future__ import annotations

import bisect
import struct
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

from cache_service.blocks import KEY_BYTES, BlockKey, BlockMeta, ChainLink, NamespaceId, StoreUsage
from cache_service.eviction import EvictionPolicy
from cache_service.store.base import AUX_TABLES, EXPIRY, SORT_KEY_BYTES, VICTIMS
from cache_service.store.codec import COLLISION, HIT, MISSING, record_size
from cache_service.store.ops import TxnStore, count_hits_by_check

# What a block costs beyond its payload and tokens here (dict slots, objects): an estimate,
# so that a byte capacity means roughly the same on this backend as on LMDB.
BLOCK_OVERHEAD_BYTES = 256


class _MemoryTxn:
    """Direct access to the store's structures; the store's lock is held while it lives."""

    def __init__(self, store: MemoryStore) -> None:
        self._s = store

    def get(self, key: BlockKey) -> BlockMeta | None:
        meta = self._s.metas.get(key)
        return replace(meta) if meta is not None else None

    def check(
        self, key: BlockKey, root_and_parent: bytes, tokens: bytes, depth: int, now: float
    ) -> int:
        meta = self._s.metas.get(key)
        if meta is None or not meta.is_alive(now):
            return MISSING
        same = (
            meta.namespace_root + meta.parent == root_and_parent
            and meta.depth == depth
            and meta.tokens == tokens
        )
        return HIT if same else COLLISION

    def count_hits(
        self, namespace: NamespaceId, links: Sequence[ChainLink], start: int, now: float
    ) -> tuple[int, int]:
        return count_hits_by_check(self, namespace, links, start, now)

    def lift_expiry(self, key: BlockKey, expires_at: float, retention: str) -> BlockKey | None:
        meta = self._s.metas.get(key)
        if meta is None or meta.expires_at >= expires_at:
            return None
        meta.expires_at, meta.retention = expires_at, retention
        return meta.parent_key if meta.depth else None

    def incarnation(self, key: BlockKey, now: float) -> bytes | None:
        meta = self._s.metas.get(key)
        if meta is None or not meta.is_alive(now):
            return None
        return struct.pack("<Q", meta.stored_seq)

    def put(self, meta: BlockMeta) -> None:
        old = self._s.metas.get(meta.key)
        if old is not None:
            self._s.record_bytes -= record_size(len(old.tokens))
        self._s.record_bytes += record_size(len(meta.tokens))
        self._s.metas[meta.key] = replace(meta)

    def delete(self, key: BlockKey) -> None:
        old = self._s.metas.pop(key, None)
        if old is not None:
            self._s.record_bytes -= record_size(len(old.tokens))
        self._s.payloads.pop(key, None)

    def get_payload(self, key: BlockKey) -> bytes | memoryview | None:
        return self._s.payloads.get(key)

    def put_payload(self, key: BlockKey, payload: bytes | memoryview) -> None:
        self._s.payloads[key] = bytes(payload)

    def get_namespace(self, root: BlockKey) -> bytes | None:
        return self._s.namespaces.get(root)

    def put_namespace(self, root: BlockKey, encoded: bytes) -> None:
        self._s.namespaces[root] = encoded

    def index_add(self, index: str, sort_key: bytes, key: BlockKey) -> None:
        bisect.insort(self._s.indexes[index], sort_key + key)

    def index_remove(self, index: str, sort_key: bytes, key: BlockKey) -> None:
        entries = self._s.indexes[index]
        entry = sort_key + key
        at = bisect.bisect_left(entries, entry)
        if at < len(entries) and entries[at] == entry:
            del entries[at]

    def index_scan(
        self, index: str, *, after: bytes | None, upto: bytes | None, limit: int
    ) -> Iterable[tuple[bytes, BlockKey]]:
        entries = self._s.indexes[index]
        at = bisect.bisect_right(entries, after) if after is not None else 0
        out: list[tuple[bytes, BlockKey]] = []
        for entry in entries[at : at + limit]:
            sort_key, key = entry[:SORT_KEY_BYTES], BlockKey(entry[SORT_KEY_BYTES:])
            if upto is not None and sort_key > upto:
                break
            out.append((sort_key, key))
        return out

    def next_seq(self, count: int) -> int:
        first = self._s.seq
        self._s.seq += count
        return first

    def add_payload_bytes(self, delta: int) -> None:
        self._s.payload_bytes += delta

    def aux_get(self, table: str, key: bytes) -> bytes | None:
        return self._s.aux[table].get(key)

    def aux_put(self, table: str, key: bytes, value: bytes) -> None:
        self._s.aux[table][key] = bytes(value)

    def aux_delete(self, table: str, key: bytes) -> None:
        self._s.aux[table].pop(key, None)

    def aux_scan(self, table: str, prefix: bytes, limit: int) -> list[tuple[bytes, bytes]]:
        entries = self._s.aux[table]
        keys = sorted(k for k in entries if k.startswith(prefix))[:limit]
        return [(k, entries[k]) for k in keys]

    def aux_count(self, table: str) -> int:
        return len(self._s.aux[table])

    def scan_blocks(self, prefix: bytes, after: bytes | None, limit: int) -> list[BlockMeta]:
        wanted = sorted(
            key
            for key in self._s.metas
            if key.startswith(prefix)
            and (prefix or len(key) == KEY_BYTES)
            and (after is None or key > after)
        )
        return [replace(self._s.metas[key]) for key in wanted[:limit]]

    def usage(self) -> StoreUsage:
        blocks = len(self._s.metas)
        used = self._s.payload_bytes + self._s.record_bytes + BLOCK_OVERHEAD_BYTES * blocks
        return StoreUsage(blocks=blocks, payload_bytes=self._s.payload_bytes, used_bytes=used)


class MemoryStore(TxnStore):
    """A BlockStore in process memory: the reference model, and the store for quick tests."""

    def __init__(self, *, policy: EvictionPolicy | None = None) -> None:
        super().__init__(policy=policy)
        self.metas: dict[BlockKey, BlockMeta] = {}
        self.payloads: dict[BlockKey, bytes] = {}
        self.namespaces: dict[BlockKey, bytes] = {}
        self.indexes: dict[str, list[bytes]] = {VICTIMS: [], EXPIRY: []}
        self.aux: dict[str, dict[bytes, bytes]] = {table: {} for table in AUX_TABLES}
        self.seq = 1
        self.payload_bytes = 0
        self.record_bytes = 0
        self._lock = threading.RLock()

    @contextmanager
    def _begin_read(self, *, views: bool = False) -> Iterator[_MemoryTxn]:
        with self._lock:
            yield _MemoryTxn(self)

    _begin_write = _begin_read

    def estimate_bytes(self, payload_size: int, token_bytes: int) -> int:
        """The space one block takes here."""
        return payload_size + record_size(token_bytes) + BLOCK_OVERHEAD_BYTES

    def reserved_bytes(self) -> int:
        """Nothing is counted for an empty store."""
        return 0

    def close(self) -> None:
        """Nothing to release."""
