"""The `redis` backend of the store contract suite: one real Redis Cluster for the session,
started when the first redis test runs, flushed before each, stopped at the session's end.

Three primaries and no replicas: the contract is about what the store keeps, not failover
(tests/redis_cluster has that), and three processes form a cluster sooner than six. Every node
has maxmemory with volatile-lru, as the store requires.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from cache_service.core.blocks import BlockMeta, StoreKey
from cache_service.core.store.parts.codec import decode_meta
from cache_service.core.store.protocols import BlockStore
from cache_service.core.store.redis.connect import parse_nodes, primaries
from cache_service.core.store.redis.store import RedisStore
from cache_service.core.store.redis.values import BLOCK_PREFIX, LENGTH, block_key, split_value

if TYPE_CHECKING:
    from bench.redis_cluster import LocalRedisCluster

MAXMEMORY_BYTES = 64 * 2**20  # per primary: far above what a contract test stores
SCAN_BATCH = 1000


def start_contract_cluster(directory: Path) -> LocalRedisCluster:
    """A started cluster for the contract suite (skips without the tools, fails under CI)."""
    from tests.redis_cluster.conftest import require_tools  # noqa: PLC0415 - redis is optional

    server, cli = require_tools()
    from bench.redis_cluster import LocalRedisCluster  # noqa: PLC0415

    return LocalRedisCluster(
        directory,
        replicas_per_primary=0,
        maxmemory_bytes=MAXMEMORY_BYTES,
        maxmemory_policy="volatile-lru",
        redis_server=server,
        redis_cli=cli,
    ).start()


def open_redis_store(
    request: pytest.FixtureRequest, tmp_path: Path, **opened_with: Any
) -> BlockStore:
    """A Redis store on the session's cluster, emptied of keys (and with no removal log,
    whatever the test asks: the store declares it keeps none)."""
    cluster: LocalRedisCluster = request.getfixturevalue("contract_redis_cluster")
    cluster.flush_all()
    nodes = ",".join(str(address) for address in cluster.primaries())
    opened_with.pop("removal_log_entries", None)
    return RedisStore(parse_nodes(nodes, tls=False), **opened_with)


class RedisRawAccess:
    """Raw access to a RedisStore's keys: SCAN on every primary, values read and written whole."""

    records_kept_up = False  # written once; the TTL is the lifetime, no child counts

    def __init__(self, store: RedisStore) -> None:
        self.client = store.client
        self.nodes = primaries(store.client, store.clustered)

    def blocks(self) -> dict[StoreKey, BlockMeta]:
        """Every stored block's record (as written: Redis keeps its lifetime in the key's TTL)."""
        found: dict[StoreKey, BlockMeta] = {}
        for node in self.nodes:
            for redis_key in node.scan_iter(match=BLOCK_PREFIX + b"*", count=SCAN_BATCH):
                value = node.get(redis_key)
                parts = None if value is None else split_value(value)
                if parts is None:  # expired since the scan, or cut short: no record to read
                    continue
                key = StoreKey(bytes(redis_key)[len(BLOCK_PREFIX) :])
                found[key] = decode_meta(key, parts[0])
        return found

    def _parts(self, key: StoreKey) -> tuple[bytes, bytes]:
        value = self.client.get(block_key(key))
        parts = None if value is None else split_value(value)
        if parts is None:
            raise KeyError(f"no whole block under {key!r}")
        return parts

    def _write(self, key: StoreKey, record: bytes, payload: bytes) -> None:
        self.client.set(block_key(key), LENGTH.pack(len(record)) + record + payload, keepttl=True)

    def overwrite_payload(self, key: StoreKey, payload: bytes) -> None:
        """Replace a block's payload bytes, keeping its record (and checksum) and its TTL."""
        self._write(key, self._parts(key)[0], payload)

    def record(self, key: StoreKey) -> bytes:
        """A block's encoded record, as stored."""
        return self._parts(key)[0]

    def flip(self, key: StoreKey, offset: int, mask: int = 0x5A) -> None:
        """XOR one byte of a block's record (a negative offset counts from its end)."""
        record, payload = self._parts(key)
        damaged = bytearray(record)
        damaged[offset] ^= mask
        self._write(key, bytes(damaged), payload)

    def seconds_left(self, key: StoreKey, now: float) -> float:
        """The key's TTL (Redis's clock: `now` is not used; -0.001 gone, -0.002 no expiry)."""
        return float(self.client.pttl(block_key(key))) / 1000
