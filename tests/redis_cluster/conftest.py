"""Real Redis Clusters for the tests here: `redis_cluster`, one per module, flushed before each
test, and `disposable_redis_cluster`, one per test, for tests that kill nodes.

Why two scopes: forming a cluster takes about two seconds (most of it `redis-cli --cluster
create` waiting for the nodes to meet), so tests that leave the topology alone share one, while a
test that kills a primary gets its own rather than leave a changed cluster to the next test.

A missing redis-server, redis-cli or redis-py skips, except under CI (the environment variable
CI set), where it fails: CI installs them, and these tests never silently skip there.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from bench.redis_cluster import LocalRedisCluster
    from cache_service.core.store.redis.connect import RedisAddress
    from cache_service.core.store.redis.store import RedisStore


def missing(reason: str) -> None:
    """Skip for a missing tool; under CI (which installs every tool) fail instead."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: the Redis Cluster tests must run)")
    pytest.skip(reason)


def require_tools() -> tuple[str, str]:
    """The paths of redis-server and redis-cli, once redis-py is known to be importable."""
    if importlib.util.find_spec("redis") is None:
        missing("redis-py is not installed (pip install 'redis>=5' 'hiredis>=2')")
    found = {name: shutil.which(name) for name in ("redis-server", "redis-cli")}
    absent = [name for name, path in found.items() if path is None]
    if absent:
        missing(f"{' and '.join(absent)} not on PATH (Debian: apt-get install redis-server)")
    return str(found["redis-server"]), str(found["redis-cli"])


STORE_MAXMEMORY_BYTES = 64 * 2**20


def start_cluster(directory: Path, *, for_the_store: bool = False) -> LocalRedisCluster:
    """A started three-primary, three-replica cluster in `directory`; `for_the_store`: with
    the maxmemory and volatile-lru policy the Redis store insists on (64 MiB a node)."""
    server, cli = require_tools()
    from bench.redis_cluster import LocalRedisCluster  # noqa: PLC0415

    memory: dict[str, Any] = (
        {"maxmemory_bytes": STORE_MAXMEMORY_BYTES, "maxmemory_policy": "volatile-lru"}
        if for_the_store
        else {}
    )
    return LocalRedisCluster(directory, redis_server=server, redis_cli=cli, **memory).start()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
    """One cluster set up for the Redis store, for a whole test module."""
    started = start_cluster(tmp_path_factory.mktemp("redis-store"), for_the_store=True)
    try:
        yield started
    finally:
        started.stop()


def store_address(cluster: LocalRedisCluster) -> RedisAddress:
    """The address of a cluster's primaries, as the Redis store takes it."""
    from cache_service.core.store.redis.connect import parse_nodes  # noqa: PLC0415

    return parse_nodes(",".join(f"{a.host}:{a.port}" for a in cluster.primaries()), tls=False)


@pytest.fixture
def store(cluster: LocalRedisCluster) -> Iterator[RedisStore]:
    """A Redis store on the emptied `cluster`."""
    from cache_service.core.store.redis.store import RedisStore  # noqa: PLC0415

    cluster.flush_all()
    opened = RedisStore(store_address(cluster))
    yield opened
    opened.close()


@pytest.fixture(scope="module")
def shared_redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
    """One cluster for a whole test module, stopped after its last test."""
    cluster = start_cluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def redis_cluster(shared_redis_cluster: LocalRedisCluster) -> LocalRedisCluster:
    """The module's cluster, emptied of keys."""
    shared_redis_cluster.flush_all()
    return shared_redis_cluster


@pytest.fixture
def disposable_redis_cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LocalRedisCluster]:
    """A cluster of this test's own, which it may break."""
    cluster = start_cluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield cluster
    finally:
        cluster.stop()
