"""The block store on Redis (a Cluster or one node): many service replicas, one shared cache.

Unlike the LMDB store, which keeps its own indexes and evicts by them, this store lets Redis
do what Redis does: every block is one string key with a native expiry (`PX`), spread over
the Cluster's slots by its own key (no hash tag: a tenant is not tied to one node), and Redis
evicts under `maxmemory` with a `volatile-*` policy. So the store is not prefix-closed: a
block in the middle of a prefix may expire or be evicted before its descendants. It never
lies for that: a lookup walks the chain from block 0 and stops at the first block that is
absent or does not verify (namespace, depth, parent, tokens and the record's checksum; with
payloads, the payload's length and checksum too).

Layout (keys are bytes; `store key` is the tenant partition then the block's 16-byte hash):

    pc:b:<store key>   u32 LE record length, the block record (store/codec.py, format 4),
                       then the payload: written once with SET NX PX (put-if-absent: two
                       writers of one block are idempotent), record and payload together
    pc:n:<scope>       the encoded namespace of a (partition, root), as LMDB keeps it

A lookup reads the records only (GETRANGE), in at most two pipelined round trips: the first
`PROBE_BLOCKS` blocks, then, if all of them verified, every other block of the prompt at
once; redis-py's cluster pipeline sends each node its commands together. A block's record
keeps an infinite expiry: the key's own TTL is its lifetime (a record is never rewritten).

What it does not do (yet), refused with `NotSupportedByStore` rather than ignored: pins,
purge under one block, the removal log and first-block hints (explanations say less);
tenant byte quotas are refused at start-up by the service. Capacity is Redis's `maxmemory`.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from cache_service.core.blocks import (
    BlockKey,
    BlockMeta,
    ChainLink,
    Evicted,
    InsertResult,
    MatchResult,
    NamespaceId,
    NewBlock,
    StoreKey,
    StoreUsage,
    Touch,
    link_parts,
    store_key,
)
from cache_service.core.errors import MissingParent, StorageFailure, StoreFull
from cache_service.core.eviction import EvictionPolicy, LruPolicy
from cache_service.core.lifetimes import UNBOUNDED, Lifetimes
from cache_service.core.store.base import IdentityCheck
from cache_service.core.store.breaker import CircuitBreaker
from cache_service.core.store.codec import (
    COLLISION,
    DAMAGED,
    HIT,
    TOKENS_AT,
    check_record,
    decode_meta,
    intact,
)
from cache_service.core.store.damage import Dropped
from cache_service.core.store.redis_connect import (
    RedisAddress,
    check_memory_settings,
    connect,
    memory_settings,
    primaries,
)
from cache_service.core.store.redis_controls import RedisControls
from cache_service.core.store.redis_values import (
    IDENTITY_KEY,
    LENGTH,
    RETENTION_SLACK,
    RedisSpace,
    block_key,
    checksum,
    is_out_of_memory,
    is_redis_error,
    namespace_key,
    pack_value,
    record_of,
    split_value,
)

PROBE_BLOCKS = 16  # the first round trip of a lookup: a miss costs little
WRITE_RETRY_SECONDS = 5.0  # covers a failover at cluster-node-timeout 1-2 s, not at 15 s
USAGE_SECONDS = 1.0  # how long a usage report (INFO on every primary) is reused


class RedisStore(RedisControls):
    """A BlockStore on Redis; see the module docstring for what it keeps and how."""

    removal_log_entries = 0

    def __init__(
        self,
        address: RedisAddress,
        *,
        policy: EvictionPolicy | None = None,
        identity: IdentityCheck | None = None,
        check_settings: bool = True,
        breaker: CircuitBreaker | None = None,
        write_retry_seconds: float = WRITE_RETRY_SECONDS,
    ) -> None:
        self.address = address
        self.write_retry_seconds = write_retry_seconds
        self.write_retries = 0  # writes tried again after Redis failed them
        self.write_failures = 0  # writes refused (503) after their retries
        self.touch_errors = 0  # hits whose expiry could not be slid (forgotten)
        self.client, self.clustered = connect(address)
        self.policy: EvictionPolicy = policy or LruPolicy()
        self.lifetimes: Lifetimes = UNBOUNDED
        self.space = RedisSpace()
        self.breaker = breaker or CircuitBreaker()
        self.lookup_errors = 0  # lookups answered as misses because Redis failed them
        self._damaged: set[StoreKey] = set()
        self._lock = threading.Lock()
        self._usage: tuple[float, StoreUsage, int] | None = None
        self.memory_settings = memory_settings(self._primaries())
        if check_settings:
            check_memory_settings(self.memory_settings)
        if identity is not None:
            self._settle_identity(identity)

    def _settle_identity(self, identity: IdentityCheck) -> None:
        """Refuse settings that define the data and differ from the ones the cluster's
        record holds (every replica must hash alike); record this process's otherwise."""
        stored = self.client.get(IDENTITY_KEY)
        record = identity.settle(
            None if stored is None else bytes(stored), where=self.address.describe()
        )
        if stored is None:
            if not self.client.set(IDENTITY_KEY, record, nx=True):  # another replica was first
                self._settle_identity(identity)
        elif record != stored:
            self.client.set(IDENTITY_KEY, record)

    def __repr__(self) -> str:
        return f"RedisStore({self.address.describe()})"

    # -- lookups --------------------------------------------------------------------------------

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
        """Count the leading links stored and verified; a Redis failure is a miss (counted)."""
        del known  # a record is never rewritten in place, but a key may be; verify each time
        empty = MatchResult(matched=0, payloads=() if with_payloads and not sink else None)
        if not links:
            return empty
        try:
            return self._match(namespace, links, now=now, with_payloads=with_payloads, sink=sink)
        except Exception as exc:  # any client or network failure: the cache forgets
            if not is_redis_error(exc):
                raise
            with self._lock:
                self.lookup_errors += 1
            return empty

    def _match(
        self,
        namespace: NamespaceId,
        links: Sequence[ChainLink],
        *,
        now: float,
        with_payloads: bool,
        sink: Callable[[int, bytes | memoryview | None], None] | None,
    ) -> MatchResult:
        part, root = namespace.partition, namespace.root
        parts = list(link_parts(links))
        matched = collisions = corrupt = 0
        collected: list[bytes] = []
        windows = [(0, min(PROBE_BLOCKS, len(parts)))]
        if len(parts) > PROBE_BLOCKS:
            windows.append((PROBE_BLOCKS, len(parts)))
        for number, (start, end) in enumerate(windows):
            pipe = self.client.pipeline(transaction=False)
            if number == 0:
                pipe.get(namespace_key(namespace.scope))
            for key, _parent, tokens, _depth in parts[start:end]:
                redis_key = block_key(store_key(part, key))
                if with_payloads:
                    pipe.get(redis_key)
                else:
                    pipe.getrange(
                        redis_key, 0, LENGTH.size + TOKENS_AT + RETENTION_SLACK + len(tokens) - 1
                    )
            answers = pipe.execute(raise_on_error=True)
            if number == 0:
                held = answers.pop(0)
                if held is not None and held != namespace.encoded:
                    return MatchResult(
                        matched=0, collisions=1, payloads=() if with_payloads and not sink else None
                    )
            for (key, parent, tokens, depth), value in zip(parts[start:end], answers, strict=True):
                skey = store_key(part, key)
                record, payload = record_of(self.client, skey, value, whole=with_payloads)
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
                        self._note_damage(skey)
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
            matched=matched, collisions=collisions, payloads=payloads, corrupt=corrupt
        )

    def get_payloads(
        self, namespace: NamespaceId, keys: Sequence[BlockKey], *, now: float
    ) -> tuple[list[bytes | None], int]:
        """Payloads of stored blocks of one namespace (None where absent, foreign or damaged)."""
        out: list[bytes | None] = [None] * len(keys)

        def keep(index: int, payload: bytes | memoryview | None) -> None:
            out[index] = None if payload is None else bytes(payload)

        return out, self.read_payloads(namespace, keys, now=now, sink=keep)

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
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.get(namespace_key(namespace.scope))
            for key in keys:
                pipe.get(block_key(store_key(part, key)))
            held, *values = pipe.execute(raise_on_error=True)
        except Exception as exc:
            if not is_redis_error(exc):
                raise
            with self._lock:
                self.lookup_errors += 1
            for index in range(len(keys)):
                sink(index, None)
            return 0
        foreign = held is not None and held != namespace.encoded
        corrupt = 0
        for index, (key, value) in enumerate(zip(keys, values, strict=True)):
            skey = store_key(part, key)
            parts = None if foreign or value is None else split_value(value)
            if parts is None:
                if value is not None and not foreign:
                    corrupt += 1
                    self._note_damage(skey)
                sink(index, None)
                continue
            record, payload = parts
            if not intact(record):
                corrupt += 1
                self._note_damage(skey)
                sink(index, None)
                continue
            meta = decode_meta(skey, record)
            if meta.namespace_root != namespace.root:
                sink(index, None)
                continue
            if len(payload) != meta.payload_size or checksum(payload) != meta.checksum:
                corrupt += 1
                self._note_damage(skey)
                sink(index, None)
                continue
            sink(index, payload)
        return corrupt

    # -- writes ---------------------------------------------------------------------------------

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
        """Store consecutive blocks, each put-if-absent with the class TTL; MissingParent if
        `parent` is not stored. A Redis failure is tried again for up to `write_retry_seconds`
        (a failover promotes a replica in a few seconds; a retried write that had landed
        reads as refreshed, never twice); past that, a 503 and the breaker counts it."""
        if not blocks:
            return InsertResult()
        self.breaker.check("store")
        deadline = time.monotonic() + self.write_retry_seconds
        pause = 0.05
        while True:
            try:
                result = self._insert(
                    namespace,
                    blocks,
                    parent=parent,
                    now=now,
                    retention=retention,
                    ttl_seconds=ttl_seconds,
                )
                break
            except Exception as exc:
                if not is_redis_error(exc):
                    raise
                if is_out_of_memory(exc):  # Redis answers, but may evict nothing
                    raise StoreFull(
                        "Redis refused the write: out of memory with nothing it may evict "
                        "(blocks without an expiry: pins); unpin, purge or raise maxmemory"
                    ) from exc
                if time.monotonic() + pause < deadline:
                    with self._lock:
                        self.write_retries += 1
                    time.sleep(pause)
                    pause = min(pause * 2, 0.5)
                    continue
                self.breaker.failed()
                with self._lock:
                    self.write_failures += 1
                raise StorageFailure(
                    f"Redis failed the store: {type(exc).__name__}: {exc}",
                    retry_after_seconds=1.0,
                ) from exc
        self.breaker.succeeded()
        return result

    def _insert(
        self,
        namespace: NamespaceId,
        blocks: Sequence[NewBlock],
        *,
        parent: ChainLink | None,
        now: float,
        retention: str,
        ttl_seconds: float,
    ) -> InsertResult:
        part = namespace.partition
        ttl_ms = max(1, math.ceil(ttl_seconds * 1000))
        pipe = self.client.pipeline(transaction=False)
        pipe.get(namespace_key(namespace.scope))
        if parent is not None:
            pipe.get(block_key(store_key(part, parent.key)))
        held, *parent_value = pipe.execute(raise_on_error=True)
        if held is not None and held != namespace.encoded:
            return InsertResult(collisions=len(blocks))  # another namespace holds this root
        if parent is not None:
            record, _ = record_of(
                self.client, store_key(part, parent.key), parent_value[0], whole=True
            )
            verdict = check_record(
                record,
                root_and_parent=namespace.root + parent.parent,
                tokens=parent.tokens,
                depth=parent.depth,
                now=now,
            )
            if verdict != HIT:
                raise MissingParent(
                    f"block {parent.depth} (the parent of block {parent.depth + 1}) is not "
                    "stored: send it in the same request (lower start_block)",
                    parent_block=parent.depth,
                )
        pipe = self.client.pipeline(transaction=False)
        if held is None:
            pipe.set(namespace_key(namespace.scope), namespace.encoded, nx=True)
        keys = []
        for block in blocks:
            link = block.link
            key = store_key(part, link.key)
            keys.append(key)
            meta = BlockMeta(
                key=key,
                namespace_root=namespace.root,
                parent=link.parent,
                depth=link.depth,
                tokens=link.tokens,
                payload_size=len(block.payload),
                checksum=checksum(block.payload),
                created_at=now,
                last_used_at=now,
                expires_at=math.inf,  # the key's TTL is the block's lifetime
                retention=retention,
            )
            pipe.set(block_key(key), pack_value(meta, block.payload), nx=True, px=ttl_ms)
        if parent is not None:  # its lifetime at least the new blocks' (ancestors: on hits)
            pipe.pexpire(block_key(store_key(part, parent.key)), ttl_ms, gt=True)
        answers = pipe.execute(raise_on_error=True)
        if held is None:
            answers.pop(0)
        written = answers[: len(blocks)]
        stored = [key for key, done in zip(keys, written, strict=True) if done]
        existing = [index for index, done in enumerate(written) if not done]
        refreshed = conflicts = collisions = 0
        if existing:
            pipe = self.client.pipeline(transaction=False)
            for index in existing:
                pipe.get(block_key(keys[index]))
                pipe.pexpire(block_key(keys[index]), ttl_ms, gt=True)
            values = pipe.execute(raise_on_error=True)[::2]
            for index, value in zip(existing, values, strict=True):
                link = blocks[index].link
                record, _ = record_of(self.client, keys[index], value, whole=True)
                verdict = check_record(
                    record,
                    root_and_parent=namespace.root + link.parent,
                    tokens=link.tokens,
                    depth=link.depth,
                    now=now,
                )
                if verdict == HIT:
                    assert record is not None
                    meta = decode_meta(keys[index], record)
                    payload = blocks[index].payload
                    refreshed += 1
                    conflicts += meta.checksum != checksum(payload) or meta.payload_size != len(
                        payload
                    )
                elif verdict == COLLISION:
                    collisions += 1
                # absent now (expired between the two round trips) or damaged: not written
        return InsertResult(
            stored=tuple(stored),
            refreshed=refreshed,
            conflicts=conflicts,
            collisions=collisions,
            prefix_touched=bool(stored or refreshed),
        )

    def touch(
        self,
        touches: Sequence[Touch],
        *,
        resolution_seconds: float = 0.0,
        slide_fraction: float = 0.0,
    ) -> None:
        """Slide the expiry of each hit's whole prefix (PEXPIRE GT), once it would move by more
        than the resolution and `slide_fraction` of the TTL: one PTTL round trip for all the
        hits' deepest blocks, one for the slides. A failure is forgotten (a hit is not a write)."""
        hits = [hit for hit in touches if hit.keys]
        if not hits:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for hit in hits:
                pipe.pttl(block_key(store_key(hit.partition, hit.keys[-1])))
            left = pipe.execute(raise_on_error=True)
            pipe = self.client.pipeline(transaction=False)
            slides = 0
            for hit, ttl_left_ms in zip(hits, left, strict=True):
                ttl_ms = math.ceil(hit.ttl_seconds * 1000)
                slack_ms = 1000 * max(resolution_seconds, hit.ttl_seconds * slide_fraction)
                if ttl_left_ms < 0 or ttl_ms - ttl_left_ms <= slack_ms:
                    continue  # gone, kept without expiry, or slid recently enough
                for key in hit.keys:
                    pipe.pexpire(block_key(store_key(hit.partition, key)), ttl_ms, gt=True)
                slides += 1
            if slides:
                pipe.execute(raise_on_error=False)
        except Exception as exc:
            if not is_redis_error(exc):
                raise
            with self._lock:
                self.touch_errors += 1

    # -- capacity, removal, damage ----------------------------------------------------------------

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
        """Nothing: Redis expires and evicts blocks on its own (maxmemory, volatile-*)."""
        return []

    def health_counts(self) -> dict[str, int]:
        """What Redis failed so far, for the metrics: lookups answered as misses, writes
        tried again and refused, hits not slid, and times the write breaker opened."""
        with self._lock:
            return {
                "lookup_errors": self.lookup_errors,
                "write_retries": self.write_retries,
                "write_failures": self.write_failures,
                "touch_errors": self.touch_errors,
                "breaker_opened": self.breaker.opened_total,
            }

    def usage(self) -> StoreUsage:
        """Keys on every primary, and the memory Redis uses (reused for USAGE_SECONDS)."""
        return self._usage_report()[0]

    def memory_limit_bytes(self) -> int:
        """The sum of the primaries' maxmemory (0: unknown or none)."""
        return self._usage_report()[1]

    def _usage_report(self) -> tuple[StoreUsage, int]:
        at = time.monotonic()
        with self._lock:
            cached = self._usage
        if cached is not None and at - cached[0] < USAGE_SECONDS:
            return cached[1], cached[2]
        blocks = used = dataset = limit = 0
        try:
            for node in self._primaries():
                memory = node.info("memory")
                used += int(memory.get("used_memory", 0))
                dataset += int(memory.get("used_memory_dataset", 0))
                limit += int(memory.get("maxmemory", 0))
                blocks += int(node.dbsize())
        except Exception as exc:
            if not is_redis_error(exc) or cached is None:
                raise
            return cached[1], cached[2]  # the last report stands while a node is away
        report = StoreUsage(blocks=blocks, payload_bytes=dataset, used_bytes=used)
        with self._lock:
            self._usage = (at, report, limit)
        return report, limit

    def tenant_bytes(self, partition: bytes) -> int:
        """Not counted on Redis (tenant quotas are refused at start-up)."""
        return 0

    def evict_tenant(
        self,
        partition: bytes,
        *,
        target_bytes: int,
        now: float,
        max_blocks: int,
        protected: frozenset[StoreKey] = frozenset(),
    ) -> list[Evicted]:
        """Nothing: no tenant quotas on Redis."""
        return []

    def drop_damaged(self, *, now: float, ttl_seconds: float) -> Dropped:
        """Unlink the blocks reads found damaged (their descendants stop matching there)."""
        with self._lock:
            damaged, self._damaged = self._damaged, set()
        for key in damaged:
            self.client.unlink(block_key(key))
        removed = tuple(Evicted(key, "corrupt", "", 0.0, 0) for key in damaged)
        return Dropped(records=len(damaged), payloads=0, removed=removed)

    def damage_pending(self) -> int:
        """How many damaged blocks reads noted since the last `drop_damaged`."""
        with self._lock:
            return len(self._damaged)

    def _note_damage(self, key: StoreKey) -> None:
        with self._lock:
            if len(self._damaged) < 65536:
                self._damaged.add(key)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """No transaction spans calls on Redis: each call stands alone."""
        yield

    def close(self) -> None:
        """Close the connections."""
        self.client.close()

    def _primaries(self) -> list[Any]:
        return primaries(self.client, self.clustered)
