"""The Redis store against a real Redis Cluster (three primaries, three replicas) and real
single redis-server processes: layout, verification, put-if-absent, TTLs, purge, refusals,
and what a Redis failure turns into (a miss for a lookup, a 503 behind a breaker for a write).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from bench.redis_cluster import LocalRedisCluster
from cache_service.core.blocks import (
    Chain,
    ChainLink,
    InsertResult,
    Namespace,
    NewBlock,
    PinLimits,
    Touch,
    store_key,
)
from cache_service.core.errors import (
    Forbidden,
    MissingParent,
    NotStored,
    QuotaExceeded,
    SettingsMismatch,
    StorageFailure,
    StoreFull,
)
from cache_service.core.hashing import BlockHasher, tenant_partition
from cache_service.core.identity import StoreIdentity, identity_of
from cache_service.core.store.redis.breaker import CircuitBreaker
from cache_service.core.store.redis.connect import check_versions, parse_nodes
from cache_service.core.store.redis.pins import pin_key
from cache_service.core.store.redis.store import RedisStore
from cache_service.core.store.redis.values import block_key
from cache_service.core.store.registry import open_store, parse_store_url
from cache_service.core.tokens import tokens_to_bytes
from tests.redis_cluster.conftest import require_tools, store_address
from tests.redis_cluster.nodes import MEMORY, single_node

BLOCK = 4
TTL = 3600.0
HASHER = BlockHasher()
NS = Namespace(model="redis-model")
NSID = HASHER.namespace_id(NS)


def chain(labels: list[int], namespace: Namespace = NS) -> Chain:
    tokens = [label for label in labels for _ in range(BLOCK)]
    return HASHER.chain(namespace, tokens_to_bytes(tokens), block_size=BLOCK)


def payload(index: int, size: int = 100) -> bytes:
    return bytes([index % 251]) * size


def put(
    store: RedisStore,
    links: Sequence[ChainLink],
    start: int = 0,
    *,
    namespace: Namespace = NS,
    ttl: float = TTL,
    pay: Callable[[int], bytes] = payload,
) -> InsertResult:
    blocks = [NewBlock(link, pay(link.depth)) for link in links[start:]]
    return store.insert(
        HASHER.namespace_id(namespace),
        blocks,
        parent=links[start - 1] if start else None,
        now=time.time(),
        retention="chat",
        ttl_seconds=ttl,
    )


def test_a_long_prefix_is_stored_spread_over_every_primary_and_matched_whole(
    store: RedisStore, cluster: LocalRedisCluster
) -> None:
    links = chain(list(range(300)))
    result = put(store, links)
    assert len(result.stored) == 300 and not result.collisions
    assert store.match(NSID, links, now=time.time()).matched == 300
    held = [cluster.node_client(a).dbsize() for a in cluster.primaries()]
    assert all(count > 50 for count in held), held  # no hash tag: spread over the slots
    got = store.match(NSID, links, now=time.time(), with_payloads=True)
    assert got.matched == 300 and got.payloads == tuple(payload(i) for i in range(300))
    fetched, corrupt = store.get_payloads(NSID, [links[5].key, links[299].key], now=time.time())
    assert fetched == [payload(5), payload(299)] and corrupt == 0
    longer = chain([*range(300), 7, 8])
    assert store.match(NSID, longer, now=time.time()).matched == 300


def test_a_gap_in_the_middle_stops_the_match_there(store: RedisStore) -> None:
    links = chain(list(range(40)))
    put(store, links)
    store.client.unlink(block_key(store_key(b"", links[25].key)))  # as if Redis evicted it
    assert store.match(NSID, links, now=time.time()).matched == 25
    got = store.match(NSID, links, now=time.time(), with_payloads=True)
    assert got.matched == 25 and got.payloads is not None and len(got.payloads) == 25


def test_damaged_records_and_payloads_are_misses_and_dropped(store: RedisStore) -> None:
    links = chain(list(range(30)))
    put(store, links)
    record_key = block_key(store_key(b"", links[20].key))
    store.client.setrange(record_key, 40, b"\xff\xfe")  # inside the record
    assert store.match(NSID, links, now=time.time()).matched == 20
    assert store.damage_pending() == 1
    payload_key = block_key(store_key(b"", links[10].key))
    size = store.client.strlen(payload_key)
    store.client.setrange(payload_key, size - 1, b"\x00")  # the payload's last byte
    # The record still verifies: a lookup without payloads counts it, as LMDB's does.
    assert store.match(NSID, links, now=time.time()).matched == 20
    got = store.match(NSID, links, now=time.time(), with_payloads=True)
    assert (got.matched, got.corrupt) == (10, 1)
    assert store.get_payloads(NSID, [links[10].key], now=time.time()) == ([None], 1)
    dropped = store.drop_damaged(now=time.time(), ttl_seconds=TTL)
    assert (dropped.records, dropped.payloads) == (1, 1) and store.damage_pending() == 0
    assert store.client.exists(record_key, payload_key) == 0


def test_put_if_absent_keeps_the_first_writer_and_counts_a_conflict(store: RedisStore) -> None:
    links = chain([1, 2, 3])
    assert len(put(store, links).stored) == 3
    again = put(store, links)
    assert (len(again.stored), again.refreshed, again.conflicts) == (0, 3, 0)
    other = put(store, links, pay=lambda depth: b"x" * 100)
    assert (other.refreshed, other.conflicts) == (3, 3)
    got = store.match(NSID, links, now=time.time(), with_payloads=True)
    assert got.payloads == tuple(payload(i) for i in range(3))


def test_a_missing_parent_is_refused_and_nothing_is_written(store: RedisStore) -> None:
    links = chain([1, 2, 3, 4])
    with pytest.raises(MissingParent):
        put(store, links, start=2)
    assert store.match(NSID, links, now=time.time()).matched == 0
    put(store, links[:2])
    assert len(put(store, links, start=2).stored) == 2
    assert store.match(NSID, links, now=time.time()).matched == 4


def test_tenants_and_namespaces_never_see_each_other(store: RedisStore) -> None:
    tenant = Namespace(model="redis-model", tenant="acme")
    put(store, chain([1, 2, 3]))
    assert (
        store.match(HASHER.namespace_id(tenant), chain([1, 2, 3], tenant), now=time.time()).matched
        == 0
    )
    put(store, chain([1, 2, 3], tenant), namespace=tenant)
    tenant_id = HASHER.namespace_id(tenant)
    assert tenant_id.partition == tenant_partition("acme")
    assert store.match(tenant_id, chain([1, 2, 3], tenant), now=time.time()).matched == 3
    # A block key of one namespace asked for in another is not handed out.
    assert store.get_payloads(tenant_id, [chain([1])[0].key], now=time.time()) == ([None], 0)


def test_blocks_live_by_native_expiry_and_a_hit_slides_the_whole_prefix(
    store: RedisStore,
) -> None:
    links = chain([1, 2, 3])
    put(store, links, ttl=0.5)
    keys = [block_key(store_key(b"", link.key)) for link in links]
    assert all(0 < store.client.pttl(key) <= 500 for key in keys)
    hit = Touch(
        keys=tuple(link.key for link in links), at=time.time(), retention="chat", ttl_seconds=60
    )
    store.touch([hit], resolution_seconds=1.0, slide_fraction=0.05)
    assert all(55_000 < store.client.pttl(key) <= 60_000 for key in keys)
    store.touch([hit], resolution_seconds=1.0, slide_fraction=0.05)  # within the slide: no-op
    short = chain([9, 8])
    put(store, short, ttl=0.2)
    time.sleep(0.4)
    assert store.match(NSID, short, now=time.time()).matched == 0
    assert store.match(NSID, links, now=time.time()).matched == 3


def test_purge_a_tenant_or_a_namespace_scans_every_primary(store: RedisStore) -> None:
    tenant = Namespace(model="redis-model", tenant="acme")
    other_model = Namespace(model="other-model", tenant="acme")
    put(store, chain(list(range(50))))
    put(store, chain(list(range(60)), tenant), namespace=tenant)
    put(store, chain(list(range(70)), other_model), namespace=other_model)
    partition = tenant_partition("acme")
    by_namespace = store.purge(
        partition, root=HASHER.namespace_id(other_model).root, now=time.time()
    )
    assert by_namespace.blocks == 70
    assert (
        store.match(
            HASHER.namespace_id(tenant), chain(list(range(60)), tenant), now=time.time()
        ).matched
        == 60
    )
    by_tenant = store.purge(partition, now=time.time())
    assert by_tenant.blocks == 60 and by_tenant.payload_bytes == 60 * 100
    assert (
        store.match(NSID, chain(list(range(50))), now=time.time()).matched == 50
    )  # default tenant


def test_a_pinned_prefix_loses_its_expiry_until_its_last_pin_lets_go(store: RedisStore) -> None:
    links = chain(list(range(10)))
    put(store, links, ttl=600)
    keys = [block_key(store_key(b"", link.key)) for link in links]
    short, created = store.pin(NSID, links[:5], now=time.time(), by="writer-key", rank=1)
    assert created and (short.blocks, short.by, short.rank) == (5, "writer-key", 1)
    assert short.bytes > 5 * 100
    store.pin(NSID, links, now=time.time(), by="writer-key", rank=1)
    assert [store.client.pttl(key) for key in keys] == [-1] * 10  # no expiry: never evicted
    again, created = store.pin(NSID, links, now=time.time(), by="admin-key", rank=2)
    assert not created and (again.by, again.rank) == ("admin-key", 2)  # taken over
    assert sorted(pin.blocks for pin in store.pins(b"")) == [5, 10]
    with pytest.raises(Forbidden):
        store.unpin(NSID, links[-1].key, now=time.time(), ttl_seconds=60, rank=1)
    assert store.unpin(NSID, links[-1].key, now=time.time(), ttl_seconds=60, rank=2) == 10
    ttls = [store.client.pttl(key) for key in keys]
    assert ttls[:5] == [-1] * 5  # still held by the short pin
    assert all(55_000 < ttl <= 60_000 for ttl in ttls[5:])
    assert store.unpin(NSID, links[4].key, now=time.time(), ttl_seconds=60, rank=1) == 5
    assert all(0 < store.client.pttl(key) <= 60_000 for key in keys)
    assert store.pins(b"") == []
    assert store.unpin(NSID, links[4].key, now=time.time(), ttl_seconds=60, rank=1) == 0
    assert store.match(NSID, links, now=time.time()).matched == 10


def test_a_prefix_not_stored_whole_is_not_pinned(store: RedisStore) -> None:
    links = chain(list(range(6)))
    put(store, links[:4])
    with pytest.raises(NotStored) as refused:
        store.pin(NSID, links, now=time.time(), by="k")
    assert refused.value.extensions["block"] == 4
    assert store.pins(b"") == [] and all(
        store.client.pttl(block_key(store_key(b"", link.key))) > 0 for link in links[:4]
    )
    assert [link.key for link in store.links_of(NSID, [link.key for link in links[:4]], now=0)] == [
        link.key for link in links[:4]
    ]
    with pytest.raises(NotStored):
        store.links_of(NSID, [links[1].key], now=0)  # not block 0


def test_pin_quotas_are_kept(store: RedisStore) -> None:
    links = chain(list(range(8)))
    put(store, links)
    with pytest.raises(QuotaExceeded):
        store.pin(NSID, links, now=time.time(), by="k", limits=PinLimits(blocks=5))
    store.pin(NSID, links[:4], now=time.time(), by="k", limits=PinLimits(blocks=5))
    with pytest.raises(QuotaExceeded):
        store.pin(NSID, links[:6], now=time.time(), by="k", limits=PinLimits(blocks=5))


def test_a_purge_lets_the_tenants_pins_go(store: RedisStore) -> None:
    tenant = Namespace(model="redis-model", tenant="acme")
    links = chain(list(range(5)), tenant)
    put(store, links, namespace=tenant)
    tenant_id = HASHER.namespace_id(tenant)
    store.pin(tenant_id, links, now=time.time(), by="k")
    purged = store.purge(tenant_partition("acme"), now=time.time())
    assert (purged.blocks, purged.pins) == (5, 1)
    assert store.pins(tenant_partition("acme")) == []
    put(store, links, namespace=tenant)  # stored again: not pinned by a stale count
    stored_again = [block_key(store_key(tenant_id.partition, link.key)) for link in links]
    assert all(store.client.pttl(key) > 0 for key in stored_again)


def test_purge_under_a_block_takes_its_subtree_and_the_pins_that_lose_blocks(
    store: RedisStore,
) -> None:
    trunk = chain(list(range(10)))
    branch = chain([*range(6), 100, 101])  # shares blocks 0..5, then its own 6 and 7
    put(store, trunk)
    put(store, branch, start=6)
    store.pin(NSID, trunk[:4], now=time.time(), by="k")  # above the purge: kept
    store.pin(NSID, trunk[:9], now=time.time(), by="k")  # loses blocks 5..8: let go
    purged = store.purge(b"", under=store_key(b"", trunk[5].key), now=time.time(), ttl_seconds=60)
    assert (purged.blocks, purged.pins) == (7, 1)  # trunk 5..9 and the branch's 6, 7
    assert store.match(NSID, trunk, now=time.time()).matched == 5
    assert store.match(NSID, branch, now=time.time()).matched == 5
    assert [pin.blocks for pin in store.pins(b"")] == [4]
    ttls = [store.client.pttl(block_key(store_key(b"", link.key))) for link in trunk[:5]]
    assert ttls[:4] == [-1] * 4 and 0 < ttls[4] <= 60_000  # block 4 is held by no pin now
    assert store.purge(b"", under=store_key(b"", trunk[7].key), now=time.time()).blocks == 0


def test_removing_a_block_takes_its_subtree_but_never_a_pinned_block(store: RedisStore) -> None:
    trunk = chain(list(range(10)))
    branch = chain([*range(6), 100, 101])
    put(store, trunk)
    put(store, branch, start=6)
    store.pin(NSID, trunk[:8], now=time.time(), by="k")  # blocks 0..7 pinned
    removed = store.remove_subtree(NSID, trunk[5].key, now=time.time())
    gone = {evicted.key for evicted in removed}
    assert gone == {store_key(b"", link.key) for link in (*trunk[8:], *branch[6:])}
    assert all(e.reason == "removed" and e.payload_size == 100 for e in removed)
    assert store.match(NSID, trunk, now=time.time()).matched == 8
    assert store.remove_subtree(NSID, chain([7, 7])[1].key, now=time.time()) == []


def test_what_the_redis_store_cannot_explain_is_said(store: RedisStore) -> None:
    links = chain([1, 2])
    put(store, links)
    assert store.inspect(NSID, links[1], now=time.time()).status == "stored"
    absent = store.inspect(NSID, chain([1, 5])[1], now=time.time())
    assert absent.status == "absent" and absent.removal is None  # no removal log on Redis
    assert store.first_block_homes(b"", links[0].tokens) == []


def test_usage_reports_the_cluster_memory_and_its_limit(store: RedisStore) -> None:
    put(store, chain(list(range(20))))
    time.sleep(1.1)  # past the reuse of the last report
    usage = store.usage()
    assert usage.blocks >= 20 and usage.used_bytes > 0
    assert store.memory_limit_bytes() == 3 * 64 * 2**20


def test_the_registry_opens_redis_urls_and_refuses_bad_ones(cluster: LocalRedisCluster) -> None:
    first = cluster.primaries()[0]
    opened = open_store(f"redis://{first.host}:{first.port}", map_size_bytes=1 << 20)
    try:
        assert opened.kind == "redis" and opened.folder is None
        assert isinstance(opened.store, RedisStore) and opened.store.clustered
        assert opened.where.startswith("redis cluster redis://")
    finally:
        opened.store.close()
    for bad, says in (
        ("redis://", "empty node"),
        ("redis://:6379", "host"),
        ("redis://h:port", "not a number"),
        ("redis://user:pw@h:1", "HOST:PORT only"),
        ("redis://h:1/0", "HOST:PORT only"),
    ):
        with pytest.raises(ValueError, match=says):
            parse_store_url(bad)


def test_settings_that_define_the_data_must_match_across_replicas(
    cluster: LocalRedisCluster,
) -> None:
    cluster.flush_all()
    first = cluster.primaries()[0]
    url = f"redis://{first.host}:{first.port}"

    def identity(seed: str) -> StoreIdentity:
        return identity_of(
            seed=seed,
            default_block_size=64,
            model_block_sizes={},
            retention_ttl_seconds={"chat": 60.0},
            capacity_bytes=1 << 30,
            high_water=0.95,
            low_water=0.85,
            eviction_policy="lru",
        )

    open_store(url, map_size_bytes=1, identity=identity("one")).store.close()
    open_store(url, map_size_bytes=1, identity=identity("one")).store.close()
    with pytest.raises(SettingsMismatch):
        open_store(url, map_size_bytes=1, identity=identity("two"))


def test_a_node_without_a_memory_limit_or_with_noeviction_is_refused(tmp_path: Path) -> None:
    with single_node(tmp_path) as (_process, port), pytest.raises(ValueError, match="noeviction"):
        RedisStore(parse_nodes(f"127.0.0.1:{port}", tls=False))
    volatile = ("--maxmemory-policy", "volatile-lru")
    with (
        single_node(tmp_path, *volatile) as (_process, port),
        pytest.raises(ValueError, match="is 0"),
    ):
        RedisStore(parse_nodes(f"127.0.0.1:{port}", tls=False))


def test_redis_down_is_a_miss_for_lookups_and_a_fast_503_for_writes(tmp_path: Path) -> None:
    with single_node(tmp_path, *MEMORY) as (process, port):
        store = RedisStore(
            parse_nodes(f"127.0.0.1:{port}", tls=False),
            breaker=CircuitBreaker(failures=2, open_for=30.0),
            write_retry_seconds=0.3,
        )
        assert not store.clustered
        links = chain([1, 2, 3])
        put(store, links)
        assert store.match(NSID, links, now=time.time()).matched == 3
        process.kill()
        process.wait()
        started = time.monotonic()
        assert store.match(NSID, links, now=time.time()).matched == 0
        assert time.monotonic() - started < 2.0  # a miss at once, not after backoffs
        assert store.lookup_errors == 1
        assert store.get_payloads(NSID, [links[0].key], now=time.time()) == ([None], 0)
        for _ in range(2):
            with pytest.raises(StorageFailure) as failed:
                put(store, chain([4, 5]))
            assert failed.value.status == 503
        started = time.monotonic()
        with pytest.raises(StorageFailure, match="refused") as refused:
            put(store, chain([4, 5]))
        # The breaker is open: refused without trying Redis (a try waits up to the 2 s socket
        # timeout; the bound is loose for a noisy machine).
        assert time.monotonic() - started < 1.0
        assert refused.value.extensions["retry_after_seconds"] > 1
        store.close()


def test_a_write_rides_out_a_short_outage_within_its_retry_window(tmp_path: Path) -> None:
    with single_node(tmp_path, *MEMORY) as (process, port):
        store = RedisStore(parse_nodes(f"127.0.0.1:{port}", tls=False), write_retry_seconds=10.0)
        process.kill()
        process.wait()
        server, _cli = require_tools()
        args = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", *MEMORY]
        restarted: list[subprocess.Popen[bytes]] = []

        def restart_soon() -> None:
            time.sleep(1.0)
            restarted.append(subprocess.Popen(args, stdout=subprocess.DEVNULL, cwd=tmp_path))

        helper = threading.Thread(target=restart_soon)
        helper.start()
        try:
            links = chain([1, 2, 3])
            assert len(put(store, links).stored) == 3  # waited for the node, then stored
            assert store.write_retries >= 1  # the store's own retries, not only redis-py's
            assert store.match(NSID, links, now=time.time()).matched == 3
        finally:
            helper.join()
            store.close()
            for started in restarted:
                started.kill()
                started.wait()


def test_under_memory_pressure_redis_evicts_blocks_but_never_a_pinned_one(tmp_path: Path) -> None:
    small = ("--maxmemory", str(4 * 2**20), "--maxmemory-policy", "volatile-lru")
    with single_node(tmp_path, *small) as (_process, port):
        store = RedisStore(parse_nodes(f"127.0.0.1:{port}", tls=False))
        try:
            pinned = chain(list(range(10)))
            put(store, pinned, pay=lambda depth: bytes([depth]) * 10_000)
            store.pin(NSID, pinned, now=time.time(), by="k")
            for batch in range(40):  # 40 x 50 x 10 kB: five times the memory limit
                others = chain([1000 + batch * 50 + i for i in range(50)])
                put(store, others, pay=lambda depth: b"o" * 10_000)
            assert store.client.dbsize() < 40 * 50  # Redis evicted within its limit
            got = store.match(NSID, pinned, now=time.time(), with_payloads=True)
            assert got.matched == 10  # every pinned block is still there, verified
            assert got.payloads == tuple(bytes([depth]) * 10_000 for depth in range(10))
        finally:
            store.close()


def test_a_redis_full_of_what_it_may_not_evict_refuses_writes_with_507_at_once(
    tmp_path: Path,
) -> None:
    small = ("--maxmemory", str(16 * 2**20), "--maxmemory-policy", "volatile-lru")
    with single_node(tmp_path, *small) as (_process, port):
        store = RedisStore(parse_nodes(f"127.0.0.1:{port}", tls=False))
        try:
            # Keys without an expiry (as pinned blocks are), then the limit lowered below
            # them: Redis may evict none, so it refuses every write with OOM.
            for index in range(4):
                store.client.set(f"persistent-{index}".encode(), b"x" * 200_000)
            store.client.config_set("maxmemory", str(2**20))
            started = time.monotonic()
            with pytest.raises(StoreFull) as full:
                put(store, chain([9999]), pay=lambda depth: b"n" * 20_000)
            assert full.value.status == 507 and "pins" in full.value.detail
            assert time.monotonic() - started < 2.0  # not the 5 s retry of a failing node
        finally:
            store.close()


def test_a_cluster_not_formed_yet_is_refused_in_one_line(tmp_path: Path) -> None:
    cluster_node = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", *MEMORY)
    with single_node(tmp_path, *cluster_node) as (_process, port):
        with pytest.raises(ValueError, match="not ready") as refused:
            RedisStore(parse_nodes(f"127.0.0.1:{port}", tls=False))
        assert "redis-cli --cluster create" in str(refused.value)


def test_a_hung_primary_makes_lookups_miss_within_the_read_timeout(
    store: RedisStore, cluster: LocalRedisCluster
) -> None:
    links = chain(list(range(100)))  # spread over every primary
    put(store, links)
    assert store.match(NSID, links, now=time.time()).matched == 100
    pid = cluster.pid(cluster.primaries()[0])
    os.kill(pid, signal.SIGSTOP)  # hung, for less than the cluster's node timeout
    try:
        started = time.monotonic()
        missed = store.match(NSID, links, now=time.time(), with_payloads=True)
        took = time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGCONT)
    assert missed.matched < 100 and store.lookup_errors == 1
    assert took < 1.5, took  # the 0.5 s read timeout, not redis-py's retries one by one
    assert store.match(NSID, links, now=time.time()).matched == 100  # back once it answers


def test_writes_are_tried_again_for_as_long_as_a_failover_of_this_cluster_may_take(
    cluster: LocalRedisCluster,
) -> None:
    address = store_address(cluster)
    fast = RedisStore(address)
    assert fast.write_retry_seconds == 5.0  # node timeout 1 s: 3 s, below the floor
    fast.close()
    cluster.config_set("cluster-node-timeout", 4000)
    try:
        slow = RedisStore(address)
        assert slow.write_retry_seconds == 9.0  # 2 x 4 s + 1 s
        slow.close()
    finally:
        cluster.config_set("cluster-node-timeout", 1000)


def test_two_pins_of_one_prefix_at_once_leave_one_pin_and_counts_that_release(
    store: RedisStore,
) -> None:
    links = chain(list(range(6)))
    put(store, links, ttl=600)
    keys = [block_key(store_key(b"", link.key)) for link in links]
    for _trial in range(10):
        answers: list[bool] = []

        def pin(into: list[bool] = answers) -> None:
            into.append(store.pin(NSID, links, now=time.time(), by="k")[1])

        racers = [threading.Thread(target=pin) for _ in range(2)]
        for racer in racers:
            racer.start()
        for racer in racers:
            racer.join()
        assert sorted(answers) == [False, True]  # one pin, told to both
        assert [store.client.pttl(key) for key in keys] == [-1] * 6
        assert store.unpin(NSID, links[-1].key, now=time.time(), ttl_seconds=60) == 6
        assert all(0 < store.client.pttl(key) <= 60_000 for key in keys)  # none left held
        assert store.pins(b"") == []


def test_a_hit_slides_the_early_blocks_of_a_prefix_that_grew_later(store: RedisStore) -> None:
    links = chain(list(range(8)))
    put(store, links[:4], ttl=20)
    put(store, links, start=4, ttl=60)  # stored later: the deepest blocks live longer
    keys = [block_key(store_key(b"", link.key)) for link in links]
    hit = Touch(keys=tuple(link.key for link in links), at=time.time(), retention="chat",
                ttl_seconds=60)  # fmt: skip
    store.touch([hit], resolution_seconds=1.0, slide_fraction=0.25)
    assert all(55_000 < store.client.pttl(key) <= 60_000 for key in keys)


def test_damaged_pin_records_are_skipped_replaced_and_purged(store: RedisStore) -> None:
    links = chain(list(range(3)))
    put(store, links)
    store.pin(NSID, links, now=time.time(), by="k")
    record = pin_key(NSID.scope, links[-1].key)
    store.client.set(record, b"\xff not a pin record")
    assert store.pins(b"") == []  # skipped, never a 500
    again, created = store.pin(NSID, links, now=time.time(), by="k")
    assert created and again.blocks == 3  # a damaged record is read as none and replaced
    store.client.set(record, b"\xff not a pin record")
    assert store.unpin(NSID, links[-1].key, now=time.time(), ttl_seconds=60) == 0
    store.pin(NSID, links, now=time.time(), by="k")
    store.client.set(record, b"\xff")
    assert store.purge(b"", now=time.time()).blocks == 3
    assert store.client.exists(record) == 0


def test_a_redis_older_than_7_is_refused() -> None:
    class Node:  # an INFO answer as Redis 6.2 gives it (a unit test of the check alone)
        def info(self, section: str) -> dict[str, str]:
            return {"redis_version": "6.2.14"}

    with pytest.raises(ValueError, match=r"Redis 6\.2\.14 is too old"):
        check_versions([Node()])
    check_versions(
        [type("Seven", (), {"info": lambda self, section: {"redis_version": "7.0.15"}})()]
    )


def test_storing_again_reads_back_records_only_and_still_tells_conflicts(store: RedisStore) -> None:
    links = chain(list(range(4)))
    long_class = "a-retention-class-name-longer-than-the-read-ahead-of-32-bytes"
    blocks = [NewBlock(link, payload(link.depth, 50_000)) for link in links]
    first = store.insert(NSID, blocks, parent=None, now=time.time(), retention=long_class,
                         ttl_seconds=TTL)  # fmt: skip
    assert len(first.stored) == 4
    before = _bytes_sent(store)
    again = store.insert(NSID, blocks, parent=None, now=time.time(), retention=long_class,
                         ttl_seconds=TTL)  # fmt: skip
    sent = _bytes_sent(store) - before
    assert (again.refreshed, again.conflicts, again.collisions) == (4, 0, 0)
    other = [NewBlock(link, b"x" * 50_000) for link in links]
    changed = store.insert(NSID, other, parent=None, now=time.time(), retention="chat",
                           ttl_seconds=TTL)  # fmt: skip
    assert (changed.refreshed, changed.conflicts) == (4, 4)
    assert sent < 50_000  # the records came back, not the 200 kB of payloads


def _bytes_sent(store: RedisStore) -> int:
    """What the primaries have sent to their clients so far."""
    return sum(int(node.info("stats")["total_net_output_bytes"]) for node in store._primaries())
