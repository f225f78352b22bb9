"""Lookups and payload reads on the Redis store: records read in at most two pipelined round
trips (the first PROBE_BLOCKS blocks, or as many as the prompt matched last time, then the
rest at once), each verified before it counts; a Redis failure is a miss (counted), never an
error for the caller."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from cache_service.core.blocks import (
    BlockKey,
    ChainLink,
    MatchResult,
    NamespaceId,
    StoreKey,
    link_parts,
    store_key,
)
from cache_service.core.lifetimes import UNBOUNDED
from cache_service.core.store.parts.codec import (
    COLLISION,
    DAMAGED,
    HIT,
    TOKENS_AT,
    CorruptRecord,
    check_record,
    checksum,
    decode_meta,
    intact,
)
from cache_service.core.store.parts.data_path import collect_payloads
from cache_service.core.store.redis.fanout import Command, Fanout, get_command, getrange_commands
from cache_service.core.store.redis.record_walk import CUT_SHORT, walk_records
from cache_service.core.store.redis.values import (
    BLOCK_PREFIX,
    LENGTH,
    RETENTION_SLACK,
    block_key,
    is_redis_error,
    namespace_key,
    record_of,
    split_value,
)

PROBE_BLOCKS = 16  # the first round trip of a lookup: a miss costs little
# A match's incarnation. Redis proves no stored copy unchanged, so the empty one: the cache
# still keeps the prompt's chain (no hashing it again) and how deep it matched, which the
# next lookup of the prompt reads at once (see match's `known`), every block verified again.
UNPROVEN = b""
MAX_DAMAGED_NOTED = 65536  # damaged keys remembered until the next drop_damaged


class RedisReads:
    """match, get_payloads and read_payloads (mixed into RedisStore)."""

    reads: Fanout
    lookup_errors: int
    _damaged: dict[StoreKey, str]  # noted by reads (record or payload), dropped by writes
    _lock: threading.Lock

    def _read_failed(self) -> None:
        """A read Redis failed: count it, and let the slot map follow a failover."""
        with self._lock:
            self.lookup_errors += 1
        self.reads.failed()

    def _note_damage(self, key: StoreKey, *, payload: bool = False) -> None:
        with self._lock:
            if len(self._damaged) < MAX_DAMAGED_NOTED:
                self._damaged[key] = "payload" if payload else "record"

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
        """Count the leading links stored and verified; a Redis failure is a miss (counted).
        `known` only sizes the first read (its n blocks at once, not a probe of
        PROBE_BLOCKS first): a key may be evicted or rewritten at any time, so every block is
        read and verified each time."""
        empty = MatchResult(matched=0, payloads=() if with_payloads and not sink else None)
        if not links:
            return empty
        try:
            return self._match(
                namespace,
                links,
                now=now,
                with_payloads=with_payloads,
                sink=sink,
                first=max(PROBE_BLOCKS, known[0]) if known else PROBE_BLOCKS,
            )
        except Exception as exc:  # any client or network failure: the cache forgets
            if not is_redis_error(exc):
                raise
            self._read_failed()
            return empty

    def _match(
        self,
        namespace: NamespaceId,
        links: Sequence[ChainLink],
        *,
        now: float,
        with_payloads: bool,
        sink: Callable[[int, bytes | memoryview | None], None] | None,
        first: int,
    ) -> MatchResult:
        part, root = namespace.partition, namespace.root
        parts = list(link_parts(links))
        matched = collisions = corrupt = 0
        collected: list[bytes] = []
        windows = [(0, min(first, len(parts)))]
        if len(parts) > first:
            windows.append((first, len(parts)))
        prefix = BLOCK_PREFIX + part  # block_key(store_key(part, key)), once per lookup
        record_end = LENGTH.size + TOKENS_AT + RETENTION_SLACK - 1  # before the tokens
        for number, (start, end) in enumerate(windows):
            window = parts[start:end]
            commands: list[Command] = []
            if number == 0:
                commands.append(get_command(namespace_key(namespace.scope)))
            if with_payloads:
                commands += [get_command(prefix + key) for key, _, _, _ in window]
            else:
                commands += getrange_commands(
                    [prefix + key for key, _, _, _ in window],
                    [record_end + len(tokens) for _, _, tokens, _ in window],
                )
            answers = self.reads.run(commands)
            if number == 0:
                held = answers.pop(0)
                if held is not None and held != namespace.encoded:
                    return MatchResult(
                        matched=0, collisions=1, payloads=() if with_payloads and not sink else None
                    )
            checked = 0
            if not with_payloads:  # records only: one loop over them all
                checked, verdict = walk_records(
                    window, answers, root=root, now=now, lifetimes=UNBOUNDED
                )
                matched += checked
                if verdict not in {HIT, CUT_SHORT}:
                    if verdict == DAMAGED:
                        self._note_damage(store_key(part, window[checked][0]))
                    collisions += verdict == COLLISION
                    return self._result(
                        matched, collisions, corrupt, with_payloads, sink, collected
                    )
            # Each block in turn: with payloads, or from a record cut short (read again).
            for (key, parent, tokens, depth), value in zip(
                window[checked:], answers[checked:], strict=True
            ):
                skey = store_key(part, key)
                record, payload = record_of(self.reads.client, skey, value, whole=with_payloads)
                verdict = check_record(
                    record, root_and_parent=root + parent, tokens=tokens, depth=depth, now=now
                )
                if verdict == DAMAGED:
                    self._note_damage(skey)
                if verdict != HIT:
                    collisions += verdict == COLLISION
                    return self._result(
                        matched, collisions, corrupt, with_payloads, sink, collected
                    )
                if with_payloads:
                    assert record is not None
                    meta = decode_meta(skey, record)
                    if (
                        payload is None
                        or len(payload) != meta.payload_size
                        or checksum(payload) != meta.checksum
                    ):
                        self._note_damage(skey, payload=True)
                        corrupt += 1
                        return self._result(
                            matched, collisions, corrupt, with_payloads, sink, collected
                        )
                    if sink is not None:
                        sink(matched, payload)
                    else:
                        collected.append(payload)
                matched += 1
        return self._result(matched, collisions, corrupt, with_payloads, sink, collected)

    @staticmethod
    def _result(  # noqa: PLR0917 - the match's running counts, in one place
        matched: int,
        collisions: int,
        corrupt: int,
        with_payloads: bool,
        sink: object,
        collected: list[bytes],
    ) -> MatchResult:
        payloads = tuple(collected) if with_payloads and sink is None else None
        return MatchResult(
            matched=matched,
            collisions=collisions,
            payloads=payloads,
            corrupt=corrupt,
            incarnation=UNPROVEN if matched else None,
        )

    def get_payloads(
        self, namespace: NamespaceId, keys: Sequence[BlockKey], *, now: float
    ) -> tuple[list[bytes | None], int]:
        """Payloads of stored blocks of one namespace (None where absent, foreign or damaged)."""
        return collect_payloads(
            lambda sink: self.read_payloads(namespace, keys, now=now, sink=sink), len(keys)
        )

    def read_payloads(
        self,
        namespace: NamespaceId,
        keys: Sequence[BlockKey],
        *,
        now: float,
        sink: Callable[[int, bytes | memoryview | None], None],
    ) -> int:
        """Hand each key's verified payload to `sink` (None where absent, foreign or damaged,
        or when Redis fails the read); the damaged count."""
        del now
        if not keys:
            return 0
        part = namespace.partition
        commands = [get_command(namespace_key(namespace.scope))]
        commands += [get_command(block_key(store_key(part, key))) for key in keys]
        try:
            held, *values = self.reads.run(commands)
        except Exception as exc:
            if not is_redis_error(exc):
                raise
            self._read_failed()
            for index in range(len(keys)):
                sink(index, None)
            return 0
        foreign = held is not None and held != namespace.encoded
        corrupt = 0
        for index, (key, value) in enumerate(zip(keys, values, strict=True)):
            skey = store_key(part, key)
            parts = None if foreign or value is None else split_value(value)
            if parts is None or not intact(parts[0]):
                if value is not None and not foreign:  # a damaged record: a miss, as on LMDB
                    self._note_damage(skey)
                sink(index, None)
                continue
            record, payload = parts
            try:
                meta = decode_meta(skey, record)
            except CorruptRecord:  # intact, yet its fields do not hold together
                meta = None
            if meta is None or meta.namespace_root != namespace.root:
                sink(index, None)
                continue
            if len(payload) != meta.payload_size or checksum(payload) != meta.checksum:
                corrupt += 1
                self._note_damage(skey, payload=True)
                sink(index, None)
                continue
            sink(index, payload)
        return corrupt
