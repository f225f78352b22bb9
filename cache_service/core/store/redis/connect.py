"""Connecting to Redis (one node or a Cluster) from a store URL, and checking the server's
settings the Redis store relies on.

    redis://HOST:PORT[,HOST:PORT...]    a Cluster (any nodes of it) or a single node
    rediss://HOST:PORT[,...]            the same over TLS

The password is never in the URL (it would show in process lists and logs): it is read from
the environment variable CACHE_SERVICE_REDIS_PASSWORD, with CACHE_SERVICE_REDIS_USERNAME for
an ACL user. Whether the server is a Cluster is asked of it (`INFO cluster`), not configured.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

PASSWORD_ENV = "CACHE_SERVICE_REDIS_PASSWORD"
USERNAME_ENV = "CACHE_SERVICE_REDIS_USERNAME"
DEFAULT_PORT = 6379
SOCKET_TIMEOUT_SECONDS = 2.0
CLIENT_RETRIES = 2  # a lookup waits at most this for a node before it is a miss
# What Redis may evict on its own: only keys with an expiry (every block has one; a pinned
# block, when pins come, will not), least recently used first.
GOOD_POLICIES = ("volatile-lru", "volatile-lfu", "volatile-ttl", "volatile-random")


@dataclass(frozen=True)
class RedisAddress:
    """The nodes a store URL names, and whether to speak TLS."""

    nodes: tuple[tuple[str, int], ...]
    tls: bool

    def describe(self) -> str:
        """The URL again, for the start-up line (no password: it is never in the URL)."""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://" + ",".join(f"{host}:{port}" for host, port in self.nodes)


def parse_nodes(location: str, *, tls: bool) -> RedisAddress:
    """The HOST:PORT list after "redis://"; ValueError naming what is wrong."""
    nodes = []
    for given in location.strip("/").split(","):
        part = given.strip()
        if not part:
            raise ValueError("redis:// needs HOST:PORT[,HOST:PORT...] (an empty node was given)")
        if "@" in part or "/" in part or "?" in part:
            raise ValueError(
                f"redis:// takes HOST:PORT only (got {part!r}): the password comes from "
                f"{PASSWORD_ENV}, and database numbers do not exist on a Cluster"
            )
        host, sep, port_text = part.rpartition(":")
        if not sep:
            host, port_text = part, str(DEFAULT_PORT)
        host = host.strip("[]")  # [::1]:6379
        try:
            port = int(port_text)
        except ValueError:
            raise ValueError(f"redis:// node {part!r}: the port is not a number") from None
        if not host or not 0 < port < 65536:
            raise ValueError(f"redis:// node {part!r}: needs a host and a port in 1..65535")
        nodes.append((host, port))
    return RedisAddress(tuple(nodes), tls)


def connect(
    address: RedisAddress,
    *,
    socket_timeout: float = SOCKET_TIMEOUT_SECONDS,
    retries: int = CLIENT_RETRIES,
) -> tuple[Any, bool]:
    """A redis-py client for the address, and whether it is a Cluster client. The first
    node that answers says which it is."""
    auth: dict[str, Any] = {
        "password": os.environ.get(PASSWORD_ENV) or None,
        "username": os.environ.get(USERNAME_ENV) or None,
        "ssl": address.tls,
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": socket_timeout,
        # Quick tries more, no backoff: the store tries a write again on its own terms
        # (RedisStore.write_retry_seconds), and lookups use a client of their own with
        # none (fanout.py). On a Cluster the count is also how often a command
        # follows a new slot map.
        "retry": Retry(NoBackoff(), retries),
    }
    errors = []
    for host, port in address.nodes:
        probe = redis.Redis(host=host, port=port, **auth)
        try:
            clustered = probe.info("cluster").get("cluster_enabled") == 1
        except redis.RedisError as exc:
            errors.append(f"{host}:{port}: {exc}")
            continue
        finally:
            probe.close()
        if not clustered:
            return redis.Redis(host=host, port=port, **auth), False
        nodes = [ClusterNode(h, p) for h, p in address.nodes]  # type: ignore[no-untyped-call]
        try:
            return RedisCluster(startup_nodes=nodes, **auth), True
        # Slots not all covered: RedisClusterException, or IndexError in redis-py 5.0 (it
        # looks for a primary that an unformed cluster does not have).
        except (redis.RedisError, RedisClusterException, IndexError) as exc:
            raise ValueError(
                f"the Redis Cluster at {address.describe()} is not ready ({exc}): form it "
                "first (redis-cli --cluster create) and wait for cluster_state:ok"
            ) from None
    raise ValueError(f"no Redis node of {address.describe()} answers: {'; '.join(errors)}")


def primaries(client: Any, clustered: bool) -> list[Any]:
    """One plain client per primary (the whole keyspace between them), for commands that
    each node answers for itself: INFO, DBSIZE, SCAN, CONFIG GET."""
    if not clustered:
        return [client]
    return [client.get_redis_connection(node) for node in client.get_primaries()]


def memory_settings(nodes: list[Any]) -> list[tuple[int, str]]:
    """(maxmemory, maxmemory-policy) of each node; nodes that refuse CONFIG (managed
    services often rename it) are left out."""
    settings = []
    for node in nodes:
        try:
            answer = node.config_get("maxmemory*")
        except redis.ResponseError:
            continue
        settings.append((int(answer.get("maxmemory", 0)), str(answer.get("maxmemory-policy"))))
    return settings


def check_memory_settings(settings: list[tuple[int, str]]) -> None:
    """ValueError when a node would never make room (noeviction) or could evict what the
    store must keep (allkeys-*), or has no memory limit at all."""
    for limit, policy in settings:
        if policy not in GOOD_POLICIES:
            raise ValueError(
                f"Redis maxmemory-policy is {policy}: the cache needs Redis to evict blocks "
                "on its own, and only blocks with an expiry; set one of "
                f"{', '.join(GOOD_POLICIES)} (volatile-lru recommended) on every node"
            )
        if limit == 0:
            raise ValueError(
                "Redis maxmemory is 0 (no limit): the cache would grow until the node is "
                "killed; set maxmemory on every node (e.g. 75% of its RAM)"
            )


def failover_seconds(nodes: list[Any]) -> float | None:
    """How long a failover may take on this cluster: twice the longest
    `cluster-node-timeout` (a primary is declared failed after it, and the replicas' election
    waits up to about as long again), plus a second; None where CONFIG is refused."""
    longest = None
    for node in nodes:
        try:
            answer = node.config_get("cluster-node-timeout")
        except redis.ResponseError:
            continue
        if "cluster-node-timeout" in answer:
            timeout = int(answer["cluster-node-timeout"]) / 1000
            longest = timeout if longest is None else max(longest, timeout)
    return None if longest is None else 2 * longest + 1.0


MINIMUM_VERSION = (7, 0)  # PEXPIRE ... GT, which slides a block's expiry without shortening it


def check_versions(nodes: list[Any]) -> None:
    """ValueError naming a node older than Redis 7.0 (Valkey reports a Redis version too)."""
    for node in nodes:
        text = str(node.info("server").get("redis_version", "0"))
        version = tuple(int(part) for part in text.split(".")[:2] if part.isdigit())
        if version < MINIMUM_VERSION:
            raise ValueError(
                f"Redis {text} is too old for the cache: it needs 7.0 or later (PEXPIRE GT), "
                "or Valkey 7.2 or later"
            )
