"""The block store on Redis (a Cluster or one node): many service replicas, one shared cache.

Unlike the LMDB store, which keeps its own indexes and evicts by them, this store lets Redis
do what Redis does: every block is one string key with a native expiry (`PX`), spread over
the Cluster's slots by its own key (no hash tag: a tenant is not tied to one node), and Redis
evicts under `maxmemory` with a `volatile-*` policy. So the store is not prefix-closed: a
block in the middle of a prefix may expire or be evicted before its descendants. It never
lies for that: a lookup walks the chain from block 0 and stops at the first block that is
absent or does not verify (namespace, depth, parent, tokens and the record's checksum; with
payloads, the payload's length and checksum too).

Layout (keys are bytes; `store key` is the tenant partition then the block's 16-byte hash;
values.py has the value's format):

    pc:b:<store key>   u32 LE record length, the block record (store/parts/codec.py, format 4),
                       then the payload: written once with SET NX PX (put-if-absent: two
                       writers of one block are idempotent), record and payload together
    pc:n:<scope>       the encoded namespace of a (partition, root), as LMDB keeps it
    pc:identity        the settings the data was made with (every replica must match)
    pc:p:..., pc:c:... pins and per-block pin counts (pins.py)

The parts: reads.py (lookups: records in at most two round trips, a failure is a miss),
fanout.py (those reads, batched per node), record_walk.py (a lookup's checks), writes.py
(stores tried again through a failover, behind a breaker; hits slide expiry), controls.py
(pins, purge, inspect), subtrees.py (what lies under a block, by a SCAN), connect.py (the
URL, the client, the server's memory settings).
A block's record keeps an infinite expiry: the key's own TTL is its lifetime.

What it does not keep: a removal log and first-block hints (explanations say less), tenants'
byte counts (tenant quotas are refused at start-up by the service). Capacity is Redis's
`maxmemory`; `evict` does nothing, as Redis evicts on its own.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from cache_service.core.blocks import (
    KEY_BYTES,
    BlockKey,
    Evicted,
    StoreKey,
    StoreUsage,
)
from cache_service.core.eviction import EvictionPolicy, make_policy
from cache_service.core.lifetimes import UNBOUNDED, Lifetimes
from cache_service.core.store.protocols import Capabilities, Dropped, IdentityCheck, OnDisk, Remote
from cache_service.core.store.redis.breaker import CircuitBreaker
from cache_service.core.store.redis.connect import (
    RedisAddress,
    check_memory_settings,
    check_versions,
    connect,
    failover_seconds,
    memory_settings,
)
from cache_service.core.store.redis.controls import RedisControls
from cache_service.core.store.redis.fanout import READ_TIMEOUT_SECONDS, Fanout
from cache_service.core.store.redis.reads import RedisReads
from cache_service.core.store.redis.subtrees import subtree
from cache_service.core.store.redis.values import (
    HEADER_BYTES,
    IDENTITY_KEY,
    UNLINK_IF_SAME,
    RedisSpace,
    block_key,
    header_facts,
    is_redis_error,
    storage_failures,
    value_damage,
)
from cache_service.core.store.redis.writes import WRITE_RETRY_SECONDS, RedisWrites

USAGE_SECONDS = 1.0  # how long a usage report (INFO on every primary) is reused


class RedisStore(RedisReads, RedisWrites, RedisControls):
    """A BlockStore on Redis; see the module docstring for what it keeps and how."""

    capabilities = Capabilities(
        "Redis",
        lacks={
            "clock_expiry": "expiry is Redis's native TTL on the real clock; `now` is not used",
            "store_eviction": "Redis evicts on its own (maxmemory, volatile-lru): its capacity "
            "is Redis's maxmemory, evict() returns [] and the store is not prefix-closed (a "
            "lookup stops at the first gap)",
            "record_upkeep": "a block's record is written once (SET NX): its lifetime is the "
            "key's TTL; use, hits, children and retention are not kept",
            "exact_usage": "usage() reports Redis's keys and memory (blocks is every key: "
            "namespace records, pins and pin counts too; payload_bytes is "
            "used_memory_dataset), and one report is reused for 1 s",
            "removal_log": "no removal log or first-block hints (explain says less)",
            "tenant_bytes": "tenant_bytes is 0: the Redis store does not count a tenant's bytes",
            "local_reads": "the blocks live on Redis servers: a client reads them through the "
            "service (or Redis)",
            "disk": "Redis keeps the blocks; its persistence is Redis's own",
        },
    )
    disk: OnDisk | None = None
    removal_log_entries = 0

    def __init__(
        self,
        address: RedisAddress,
        *,
        policy: EvictionPolicy | None = None,
        identity: IdentityCheck | None = None,
        lifetimes: Lifetimes = UNBOUNDED,
        check_settings: bool = True,
        breaker: CircuitBreaker | None = None,
        write_retry_seconds: float | None = None,
    ) -> None:
        self.address = address
        self.remote: Remote | None = self  # health_counts, memory_limit_bytes
        self.write_retries = 0  # writes tried again after Redis failed them
        self.write_failures = 0  # writes refused (503) after their retries
        self.touch_errors = 0  # hits whose expiry could not be slid (forgotten)
        self.client, self.clustered = connect(address)
        reader, _ = connect(address, socket_timeout=READ_TIMEOUT_SECONDS, retries=0)
        self.reads = Fanout(reader, self.clustered)  # lookups: parallel, no retries
        self.policy: EvictionPolicy = policy or make_policy()
        self.lifetimes = lifetimes  # unpinning gives a block the longest class's TTL
        self.space = RedisSpace()
        self.breaker = breaker or CircuitBreaker()
        self.lookup_errors = 0  # lookups answered as misses because Redis failed them
        self._damaged: dict[StoreKey, str] = {}  # noted by reads: record or payload
        self._lock = threading.Lock()
        self._usage: tuple[float, StoreUsage, int] | None = None
        check_versions(self._primaries())
        self.memory_settings = memory_settings(self._primaries())
        # A write is tried again for as long as a failover of this cluster may take (at
        # least WRITE_RETRY_SECONDS), so that it lands on the promoted replica.
        failover = failover_seconds(self._primaries()) if self.clustered else None
        self.write_retry_seconds = (
            write_retry_seconds
            if write_retry_seconds is not None
            else max(WRITE_RETRY_SECONDS, failover or 0.0)
        )
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

    @storage_failures
    def usage(self) -> StoreUsage:
        """Keys on every primary, and the memory Redis uses (reused for USAGE_SECONDS)."""
        return self._usage_report()[0]

    @storage_failures
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

    @storage_failures
    def drop_damaged(self, *, now: float, ttl_seconds: float) -> Dropped:
        """Unlink the blocks reads found damaged and still are (read again: one stored anew
        since is kept), each only if its value is still the damaged one read here; their
        descendants stop matching there."""
        with self._lock:
            noted, self._damaged = self._damaged, {}
        keys = list(noted)
        values = self._values(keys)
        records = payloads = 0
        removed = []
        for key, value in zip(keys, values, strict=True):
            kind = value_damage(value) if value is not None else None
            if kind is None or value is None:
                continue  # gone, or whole again
            partition, top = key[:-KEY_BYTES], BlockKey(key[-KEY_BYTES:])
            # Its descendants first found (by their parent links, in any namespace: a
            # damaged record's root is not to be trusted), then it, then them.
            below = [k for k, _parent in subtree(self._primaries(), partition, None, top)[1:]]
            if not self._unlink_if(block_key(key), value):
                continue  # rewritten since the read: not ours to judge
            records += kind == "record"
            payloads += kind == "payload"
            retention, expires_at, size = header_facts(value[:HEADER_BYTES])
            removed.append(Evicted(key, "corrupt", retention, expires_at, size))
            self._let_pins_go(partition, {key, *below}, ttl_seconds)
            removed += self._remove_keys(below, reason="corrupt")
        return Dropped(records=records, payloads=payloads, removed=tuple(removed))

    def _values(self, keys: list[StoreKey]) -> list[bytes | None]:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.get(block_key(key))
        return list(pipe.execute(raise_on_error=True)) if keys else []

    def _unlink_if(self, redis_key: bytes, value: bytes) -> bool:
        script = self.client.register_script(UNLINK_IF_SAME)
        return bool(script(keys=[redis_key], args=[value]))

    def damage_pending(self) -> int:
        """How many damaged blocks reads noted since the last `drop_damaged`."""
        with self._lock:
            return len(self._damaged)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """No transaction spans calls on Redis: each call stands alone."""
        yield

    def close(self) -> None:
        """Close the connections."""
        self.reads.close()
        self.client.close()
