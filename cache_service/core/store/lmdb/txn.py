"""One LMDB transaction as the store's data path sees it (`Txn`): the hot paths read raw
records and verify each record's checksum before they trust any field of it."""

from __future__ import annotations

import logging
import math
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from cache_service.core.blocks import (
    KEY_BYTES,
    BlockMeta,
    Chain,
    ChainLink,
    NamespaceId,
    StoreKey,
    StoreUsage,
)
from cache_service.core.lifetimes import UNBOUNDED, Lifetimes
from cache_service.core.store.parts import generic
from cache_service.core.store.parts.backend import SORT_KEY_BYTES, PayloadSink
from cache_service.core.store.parts.codec import (
    DAMAGED,
    DEPTH,
    DEPTH_AT,
    EXPIRES,
    EXPIRES_AT,
    MISSING,
    PARENT_AT,
    PARENT_END,
    PAYLOAD_AT,
    PAYLOAD_FIELDS,
    RECORD_VERSION,
    RETENTION_LEN_AT,
    ROOT_AT,
    STORED_SEQ_AT,
    STORED_SEQ_END,
    SUM_BYTES,
    TOKENS_AT,
    VERSION_AT,
    CorruptRecord,
    check_record,
    checksum,
    decode_meta,
    encode_meta,
    intact,
    raw_alive,
    seal,
)
from cache_service.core.store.parts.damage import DamageLog, Salvage

log = logging.getLogger("cache_service")
_SEQ = b"seq"
_PAYLOAD_BYTES = b"payload_bytes"
_LATEST_WRITE = b"latest_write"  # the latest clock an expiry was counted from (see Txn)
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")
_I64 = struct.Struct("<q")


class LmdbTables(Protocol):
    """What a transaction reads of its backend: the tables, the damage log, the lifetimes."""

    dbs: dict[str, Any]
    main_db: Any
    damage: DamageLog
    lifetimes: Lifetimes


class LmdbTxn:
    """The data-path primitives over one LMDB transaction; the hot paths read raw records, and
    verify each record's checksum before they trust any field of it."""

    def __init__(self, backend: LmdbTables, txn: Any) -> None:
        self._backend = backend
        self._txn = txn
        self._dbs = backend.dbs
        self._blocks = backend.dbs["blocks"]
        self._payload_delta = 0
        self._noted_write = -math.inf  # the latest write clock noted, written once at commit
        self.damaged: set[StoreKey] = set()
        self.lifetimes = backend.lifetimes

    def _note(self, key: bytes) -> None:
        """A record under `key` failed verification: read as absent, dropped later."""
        self.damaged.add(StoreKey(key))
        self._backend.damage.note_record(StoreKey(key))

    def get(self, key: StoreKey) -> BlockMeta | None:
        record = self._txn.get(key, db=self._blocks)
        if record is None:
            return None
        try:
            return decode_meta(key, record)
        except CorruptRecord:
            self._note(key)
            return None

    def salvage(self, key: StoreKey) -> Salvage | None:
        record = self._txn.get(key, db=self._blocks)
        if record is None or intact(record):
            return None
        raw = bytes(record)
        payload = self._txn.get(key, db=self._dbs["payloads"])
        return Salvage(len(raw), len(payload) if payload is not None else 0,
                       raw[PARENT_AT:PARENT_END])  # fmt: skip

    def check(
        self, key: StoreKey, root_and_parent: bytes, tokens: bytes, depth: int, now: float
    ) -> int:
        status = check_record(
            self._txn.get(key, db=self._blocks),
            root_and_parent=root_and_parent,
            tokens=tokens,
            depth=depth,
            now=now,
            lifetimes=self.judging(now),
        )
        if status == DAMAGED:
            self._note(key)
            return MISSING
        return status

    def count_hits(
        self, namespace: NamespaceId, links: Sequence[ChainLink], start: int, now: float
    ) -> tuple[int, int]:
        if not isinstance(links, Chain):
            return generic.count_hits(self, namespace, links, start, now)
        return self._walk(namespace, links, start, now, None)

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
        if not isinstance(links, Chain):
            return generic.read_hits(
                self, namespace, links, now, sink, copied=copied, damage=damage
            )
        get, payloads, corrupt = self._txn.get, self._dbs["payloads"], 0

        def take(depth: int, stored: bytes, raw: bytes) -> bool:
            # The payload's size and checksum, straight from the verified record.
            nonlocal corrupt
            payload = get(stored, db=payloads)
            if payload is not None and copied:
                payload = bytes(payload)
            size, sum_ = PAYLOAD_FIELDS.unpack_from(raw, PAYLOAD_AT)
            if payload is None or len(payload) != size or checksum(payload) != sum_:
                damage.note_payload(StoreKey(stored))
                corrupt = 1
                return False
            sink(depth, payload)
            return True

        matched, collisions = self._walk(namespace, links, 0, now, take)
        return matched, collisions, corrupt

    def _walk(
        self,
        namespace: NamespaceId,
        links: Chain,
        start: int,
        now: float,
        take: Callable[[int, bytes, bytes], bool] | None,
    ) -> tuple[int, int]:
        """How many blocks from `start` are stored, alive and verified (and, with `take`,
        taken: it reads the payload and may end the run), and 1 if a collision ended it."""
        # check_record, unrolled over the chain's own arrays: a 32k-token lookup runs this
        # body 512 times, so it builds no tuples, links or concatenations.
        get, blocks, digest = self._txn.get, self._blocks, seal
        keys, tokens, stride = links.keys, links.token_bytes, links.stride
        partition, root = namespace.partition, namespace.root
        parent = keys[start - 1] if start else root
        unpack_expires, unpack_depth = EXPIRES.unpack_from, DEPTH.unpack_from
        lifetimes = self.judging(now)
        shortest = lifetimes.shortest_bound  # within it, no block is from the future
        for depth in range(start, len(keys)):
            key = keys[depth]
            stored = partition + key if partition else key
            raw = get(stored, db=blocks)
            if raw is None:
                return depth - start, 0
            if (  # codec.intact, inline: the checksum first, then any field
                len(raw) < TOKENS_AT
                or raw[VERSION_AT] != RECORD_VERSION
                or raw[:SUM_BYTES] != digest(raw[SUM_BYTES:])
            ):
                self._note(stored)
                return depth - start, 0
            expires_at = unpack_expires(raw, EXPIRES_AT)[0]
            if now >= expires_at or (
                expires_at - now > shortest and not raw_alive(raw, expires_at, now, lifetimes)
            ):
                return depth - start, 0  # expired, or stored while the clock ran ahead
            offset = depth * stride
            if (
                raw[ROOT_AT:PARENT_AT] != root
                or raw[PARENT_AT:PARENT_END] != parent
                or unpack_depth(raw, DEPTH_AT)[0] != depth
                or raw[TOKENS_AT + raw[RETENTION_LEN_AT] :] != tokens[offset : offset + stride]
            ):
                return depth - start, 1
            if take is not None and not take(depth, stored, raw):
                return depth - start, 0
            parent = key
        return len(keys) - start, 0

    def judging(self, now: float) -> Lifetimes:
        """What bounds a block's expiry at `now`: nothing while the clock reads no earlier
        than the latest write (every expiry was then counted from a clock at most
        `slack_seconds` ahead: none is from the future), so a lookup reads no class names."""
        return self.lifetimes if self.latest_write() > now else UNBOUNDED

    def _intact(self, key: StoreKey) -> bytes | None:
        """The raw record under `key` if it passes verification (a damaged one is noted)."""
        raw = self._txn.get(key, db=self._blocks)
        if raw is None:
            return None
        if not intact(raw):
            self._note(key)
            return None
        return bytes(raw)

    def lift_expiry(self, key: StoreKey, expires_at: float, retention: str) -> StoreKey | None:
        raw = self._intact(key)
        if raw is None or EXPIRES.unpack_from(raw, EXPIRES_AT)[0] >= expires_at:
            return None
        depth = DEPTH.unpack_from(raw, DEPTH_AT)[0]
        parent = StoreKey(key[:-KEY_BYTES] + raw[PARENT_AT:PARENT_END]) if depth else None
        if raw[TOKENS_AT : TOKENS_AT + raw[RETENTION_LEN_AT]] == retention.encode():
            record = bytearray(raw)  # the same class: patch the expiry in place, and reseal
            EXPIRES.pack_into(record, EXPIRES_AT, expires_at)
            record[:SUM_BYTES] = seal(memoryview(record)[SUM_BYTES:])
            self._txn.put(key, record, db=self._blocks)
        else:  # another class name, another record length: re-encode
            meta = self.get(key)
            if meta is None:
                return None
            meta.expires_at, meta.retention = expires_at, retention
            self.put(meta)
        return parent

    def incarnation(self, key: StoreKey, now: float) -> bytes | None:
        raw = self._intact(key)
        if raw is None:
            return None
        expires_at = EXPIRES.unpack_from(raw, EXPIRES_AT)[0]
        if now >= expires_at or not raw_alive(raw, expires_at, now, self.judging(now)):
            return None
        return raw[STORED_SEQ_AT:STORED_SEQ_END]

    def put(self, meta: BlockMeta) -> None:
        self._txn.put(meta.key, encode_meta(meta), db=self._dbs["blocks"])

    def delete(self, key: StoreKey) -> None:
        self._txn.delete(key, db=self._dbs["blocks"])
        self._txn.delete(key, db=self._dbs["payloads"])

    def get_payload(self, key: StoreKey) -> bytes | memoryview | None:
        payload: bytes | memoryview | None = self._txn.get(key, db=self._dbs["payloads"])
        return payload

    def put_payload(self, key: StoreKey, payload: bytes | memoryview) -> None:
        self._txn.put(key, payload, db=self._dbs["payloads"])

    def get_namespace(self, scope: StoreKey) -> bytes | None:
        found = self._txn.get(scope, db=self._dbs["namespaces"])
        return bytes(found) if found is not None else None

    def put_namespace(self, scope: StoreKey, encoded: bytes) -> None:
        self._txn.put(scope, encoded, db=self._dbs["namespaces"])

    def index_add(self, index: str, sort_key: bytes, key: StoreKey) -> None:
        self._txn.put(sort_key + key, b"", db=self._dbs[index])

    def index_remove(self, index: str, sort_key: bytes, key: StoreKey) -> None:
        self._txn.delete(sort_key + key, db=self._dbs[index])

    def index_scan(
        self, index: str, *, after: bytes | None, upto: bytes | None, limit: int
    ) -> Iterable[tuple[bytes, StoreKey]]:
        out: list[tuple[bytes, StoreKey]] = []
        with self._txn.cursor(db=self._dbs[index]) as cursor:
            positioned = cursor.set_range(after) if after is not None else cursor.first()
            if positioned and after is not None and bytes(cursor.key()) == after:
                positioned = cursor.next()
            while positioned and len(out) < limit:
                entry = bytes(cursor.key())
                sort_key, key = entry[:SORT_KEY_BYTES], StoreKey(entry[SORT_KEY_BYTES:])
                if upto is not None and sort_key > upto:
                    break
                out.append((sort_key, key))
                positioned = cursor.next()
        return out

    def aux_get(self, table: str, key: bytes) -> bytes | None:
        found = self._txn.get(key, db=self._dbs[table])
        return bytes(found) if found is not None else None

    def aux_put(self, table: str, key: bytes, value: bytes) -> None:
        self._txn.put(key, value, db=self._dbs[table])

    def aux_delete(self, table: str, key: bytes) -> None:
        self._txn.delete(key, db=self._dbs[table])

    def aux_scan(self, table: str, prefix: bytes, limit: int) -> list[tuple[bytes, bytes]]:
        out: list[tuple[bytes, bytes]] = []
        with self._txn.cursor(db=self._dbs[table]) as cursor:
            positioned = cursor.set_range(prefix)
            while positioned and len(out) < limit:
                key = bytes(cursor.key())
                if not key.startswith(prefix):
                    break
                out.append((key, bytes(cursor.value())))
                positioned = cursor.next()
        return out

    def aux_count(self, table: str) -> int:
        return int(self._txn.stat(self._dbs[table])["entries"])

    def scan_blocks(self, prefix: bytes, after: bytes | None, limit: int) -> list[BlockMeta]:
        out: list[BlockMeta] = []
        with self._txn.cursor(db=self._blocks) as cursor:
            positioned = cursor.set_range(after if after is not None else prefix)
            if positioned and after is not None and bytes(cursor.key()) == after:
                positioned = cursor.next()
            while positioned and len(out) < limit:
                key = bytes(cursor.key())
                if not key.startswith(prefix):
                    break
                if prefix or len(key) == KEY_BYTES:  # the default tenant's keys have no prefix
                    try:
                        out.append(decode_meta(StoreKey(key), cursor.value()))
                    except CorruptRecord:
                        self._note(key)  # skipped here; drop_damaged takes it out
                positioned = cursor.next()
        return out

    def _counter(self, name: bytes, codec: struct.Struct) -> int:
        raw = self._txn.get(name, db=self._dbs["meta"])
        if raw is None:
            return 0
        if len(raw) != codec.size:  # a damaged counter: worked out again from the records
            return self._recount(name)
        return int(codec.unpack(raw)[0])

    def _payload_total(self) -> int:
        """The payload bytes stored, this transaction's changes included."""
        raw = self._txn.get(_PAYLOAD_BYTES, db=self._dbs["meta"])
        if raw is not None and len(raw) != _I64.size:
            return self._recount(_PAYLOAD_BYTES)  # read from the records: changes included
        return self._counter(_PAYLOAD_BYTES, _I64) + self._payload_delta

    def _recount(self, name: bytes) -> int:
        """A damaged counter's value from the block records (a scan, so only on damage): the
        next sequence past every stored one, or the payload bytes they hold."""
        log.warning("the store's %s counter is damaged: recounted from the block records", name)
        next_seq, payload_bytes = 1, 0
        with self._txn.cursor(db=self._blocks) as cursor:
            for key, record in cursor:
                try:
                    meta = decode_meta(StoreKey(bytes(key)), record)
                except CorruptRecord:
                    continue  # its own damage is found and dropped as any other
                next_seq = max(next_seq, meta.stored_seq + 1, meta.eviction_rank + 1)
                payload_bytes += meta.payload_size
        return next_seq if name == _SEQ else payload_bytes

    def next_seq(self, count: int) -> int:
        first = self._counter(_SEQ, _U64) or 1
        self._txn.put(_SEQ, _U64.pack(first + count), db=self._dbs["meta"])
        return first

    def add_payload_bytes(self, delta: int) -> None:
        # Summed here and written once before commit: one counter write per transaction.
        self._payload_delta += delta

    def latest_write(self) -> float:
        return max(self._stored_latest_write(), self._noted_write)

    def _stored_latest_write(self) -> float:
        raw = self._txn.get(_LATEST_WRITE, db=self._dbs["meta"])
        if raw is None:
            return -math.inf
        if len(raw) != _F64.size:  # damaged: judge every block by its class until a sweep
            return math.inf
        return float(_F64.unpack(raw)[0])

    def note_write(self, at: float) -> None:
        self._noted_write = max(self._noted_write, at)

    def set_latest_write(self, at: float) -> None:
        self._noted_write = -math.inf
        self._txn.put(_LATEST_WRITE, _F64.pack(at), db=self._dbs["meta"])

    def flush(self) -> None:
        """Write the counters this transaction changed."""
        noted = self._noted_write
        if noted > -math.inf:
            # Kept to the slack's grain: a clock that only goes forward costs one more meta
            # write a second at most, not one per transaction.
            if noted > self._stored_latest_write() + self.lifetimes.slack_seconds:
                self._txn.put(_LATEST_WRITE, _F64.pack(noted), db=self._dbs["meta"])
            self._noted_write = -math.inf
        if self._payload_delta:
            total = self._payload_total()
            self._txn.put(_PAYLOAD_BYTES, _I64.pack(total), db=self._dbs["meta"])
            self._payload_delta = 0

    def usage(self) -> StoreUsage:
        pages = 2  # the two LMDB meta pages
        psize = 4096
        for db in (*self._dbs.values(), self._backend.main_db):
            stat = self._txn.stat(db)
            psize = stat["psize"]
            pages += stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
        blocks = int(self._txn.stat(self._dbs["blocks"])["entries"])
        return StoreUsage(
            blocks=blocks,
            payload_bytes=self._payload_total(),
            used_bytes=pages * psize,
        )
