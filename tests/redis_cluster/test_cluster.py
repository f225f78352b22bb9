"""The Redis Cluster harness against real redis-server processes: the topology it reports, keys
spread over every primary, PEXPIRE across the cluster, stop(), and the kill -9 of a primary during
a stream of writes through redis-py's cluster client."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from redis.cluster import RedisCluster

    from bench.redis_cluster import LocalRedisCluster

SLOTS = 16384
SPREAD_KEYS = 1000
WRITES_BEFORE_KILL = 300
WRITES_AFTER_FAILOVER = 300
WAIT_SECONDS = 15.0


def wait_until(
    condition: Callable[[], object], what: str, timeout_seconds: float = WAIT_SECONDS
) -> None:
    """Poll `condition` until it is true, or fail saying `what` never happened."""
    deadline = time.monotonic() + timeout_seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_seconds} s")
        time.sleep(0.05)


def test_three_primaries_each_followed_by_one_replica(redis_cluster: LocalRedisCluster) -> None:
    primaries = redis_cluster.primaries()
    assert len(primaries) == 3
    assert sum(n.slot_count for n in redis_cluster.nodes() if n.address in primaries) == SLOTS
    followers = {p: redis_cluster.replicas_of(p) for p in primaries}
    assert all(len(replicas) == 1 for replicas in followers.values())
    assert set(primaries) | {r for rs in followers.values() for r in rs} == set(
        redis_cluster.addresses
    )
    for primary, (replica,) in followers.items():
        replication = redis_cluster.node_client(replica).info("replication")
        assert replication["role"] == "slave"
        assert int(replication["master_port"]) == primary.port
        assert replication["master_link_status"] == "up"


def test_keys_spread_over_all_three_primaries(redis_cluster: LocalRedisCluster) -> None:
    keys = [f"spread:{i}" for i in range(SPREAD_KEYS)]
    with redis_cluster.cluster_client() as client:
        pipeline = client.pipeline()
        for key in keys:
            pipeline.set(key, key)
        assert all(pipeline.execute())
    expected = Counter(redis_cluster.primaries_of(keys).values())
    held = {p: redis_cluster.node_client(p).dbsize() for p in redis_cluster.primaries()}
    assert held == dict(expected)  # each primary holds exactly the keys of its slots
    assert all(SPREAD_KEYS * 0.25 < count < SPREAD_KEYS * 0.42 for count in held.values()), held
    copies = {redis_cluster.replicas_of(p)[0]: count for p, count in held.items()}

    def replicas_caught_up() -> bool:
        return all(redis_cluster.node_client(r).dbsize() == n for r, n in copies.items())

    wait_until(replicas_caught_up, "every replica holds its primary's keys")


def test_pexpire_expires_keys_on_every_primary(redis_cluster: LocalRedisCluster) -> None:
    ttl_ms = 1000
    expiring = [f"expiring:{i}" for i in range(60)]
    kept = [f"kept:{i}" for i in range(60)]
    owners = redis_cluster.primaries_of(expiring)
    assert set(owners.values()) == set(redis_cluster.primaries())
    with redis_cluster.cluster_client() as client:
        for key in expiring + kept:
            assert client.set(key, "v")
        assert all(client.pexpire(key, ttl_ms) for key in expiring)
        expired_by = time.monotonic() + ttl_ms / 1000
        for key in expiring:  # the TTL is on the node that owns the key, not only in the client
            assert 0 < redis_cluster.node_client(owners[key]).pttl(key) <= ttl_ms
        assert all(client.pttl(key) == -1 for key in kept)
        time.sleep(max(0.0, expired_by + 0.05 - time.monotonic()))
        assert [key for key in expiring if client.exists(key)] == []
        assert all(client.exists(key) for key in kept)


def test_stop_ends_every_process_and_is_idempotent(
    disposable_redis_cluster: LocalRedisCluster,
) -> None:
    cluster = disposable_redis_cluster
    pids = [cluster.pid(a) for a in cluster.addresses]
    cluster.stop()
    cluster.stop()
    assert cluster.live_addresses() == []
    for pid in pids:  # reaped by stop(), so the PID no longer names a process
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    for address in cluster.addresses:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(address, timeout=1.0).close()


@dataclass
class Writer:
    """Writes key:0, key:1, ... through one cluster client on a thread, each until acknowledged."""

    client: RedisCluster
    acked: list[tuple[str, float]] = field(default_factory=list)
    errors: list[tuple[str, float]] = field(default_factory=list)  # (name, attempt began)
    failure: BaseException | None = None
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        """Write until stopped; a connection or cluster-down error retries the same key."""
        # redis-py is optional (not in the [test] extra): imported where the fixture vouched for it.
        from redis.exceptions import (  # noqa: PLC0415
            ClusterDownError,
            ConnectionError,
            TimeoutError,
        )

        index = 0
        try:
            while not self.stop.is_set():
                key = f"key:{index}"
                # An error is dated when its attempt began: a SET sent to the victim before the
                # failover can spend its retries past it and fail after (seen under load).
                began = time.monotonic()
                try:
                    self.client.set(key, key)
                except (ConnectionError, TimeoutError, ClusterDownError) as error:
                    self.errors.append((type(error).__name__, began))
                    time.sleep(0.02)
                    continue
                self.acked.append((key, time.monotonic()))
                index += 1
        except BaseException as error:  # shown by the test, not lost with the thread
            self.failure = error


def test_cluster_client_rides_out_kill_of_a_primary(
    disposable_redis_cluster: LocalRedisCluster,
) -> None:
    cluster = disposable_redis_cluster
    victim = cluster.primaries()[0]
    victim_pid, victim_slots = cluster.pid(victim), cluster.slots_of(victim)
    (heir,) = cluster.replicas_of(victim)
    with cluster.cluster_client() as client:
        writer = Writer(client)
        thread = threading.Thread(target=writer.run, name="cluster-writer")
        thread.start()
        try:
            wait_until(lambda: len(writer.acked) >= WRITES_BEFORE_KILL, "writes before the kill")
            cluster.kill_primary(victim)
            failover_seconds = cluster.wait_for_failover(victim)
            recovered_at = time.monotonic()
            acked_at_recovery = len(writer.acked)
            wait_until(
                lambda: len(writer.acked) >= acked_at_recovery + WRITES_AFTER_FAILOVER,
                "writes after the failover",
            )
        finally:
            writer.stop.set()
            thread.join(timeout=WAIT_SECONDS)
        assert writer.failure is None, repr(writer.failure)
        assert not thread.is_alive()

        with pytest.raises(ProcessLookupError):
            os.kill(victim_pid, 0)
        primaries = cluster.primaries()
        assert len(primaries) == 3
        assert heir in primaries
        assert victim not in primaries
        assert cluster.slots_of(heir) == victim_slots  # the replica took the victim's slots

        keys = [key for key, _ in writer.acked]
        values = client.mget_nonatomic(keys)
        present = {key for key, value in zip(keys, values, strict=True) if value == key.encode()}
        on_victim = {k for k, primary in cluster.primaries_of(keys).items() if primary == heir}
        lost = [k for k in keys if k not in present]
        # Replication is asynchronous: only writes acknowledged on the victim's shard before
        # the failover completed may be lost; every other acknowledged write is there.
        assert set(lost) <= on_victim & set(keys[:acked_at_recovery])

    errors_after = [name for name, at in writer.errors if at > recovered_at]
    assert errors_after == []  # once failed over, redis-py follows the new primary itself
    print(
        f"\nfailover of {victim}: {failover_seconds:.2f} s from kill -9 to cluster_state:ok "
        f"(node timeout {cluster.node_timeout_ms} ms); {len(keys)} writes acknowledged, "
        f"{len(lost)} lost of {len(on_victim)} on the victim's shard; errors seen by "
        f"the writer: {dict(Counter(name for name, _ in writer.errors))}"
    )
