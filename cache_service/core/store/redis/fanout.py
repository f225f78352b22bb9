"""Reads sent to every Redis node at once, each node's share as one plain pipeline, with no
retries: what a lookup needs, where a failure must be a miss at once.

redis-py's cluster pipeline follows MOVED and retries failed commands one at a time, each with
its own timeout and retries: right for writes, but it makes a lookup wait for seconds while a
primary hangs or fails over. Here each key is routed by the client's slot map, the nodes'
pipelines run in parallel, and any error (a node down or hung past the read timeout, MOVED,
CLUSTERDOWN) fails the whole read, which the caller answers as a miss. After a failure the
slot map is read again, at most once a second, so the next lookups follow a failover.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis

READ_TIMEOUT_SECONDS = 0.5  # a node slower than this fails the lookup: a miss
REFRESH_SECONDS = 1.0
Command = tuple[str, bytes, tuple[Any, ...]]  # (method, key, other arguments)


class Fanout:
    """Runs read commands over a cluster (or one node) in parallel, failing fast."""

    def __init__(self, client: Any, clustered: bool) -> None:
        self.client = client
        self.clustered = clustered
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="redis-read")
        self._refreshed_at = 0.0
        self._lock = threading.Lock()

    def run(self, commands: list[Command]) -> list[Any]:
        """The commands' replies in order; raises the first error (a redis error). A slot
        that moved (MOVED: a reshard, or a failover the map missed) is followed once."""
        try:
            return self._run(commands)
        except redis.exceptions.MovedError:
            self.failed(force=True)
            return self._run(commands)

    def _run(self, commands: list[Command]) -> list[Any]:
        if not self.clustered:
            return _pipeline(self.client, commands)
        groups: dict[str, tuple[Any, list[int]]] = {}
        for index, (_method, key, _args) in enumerate(commands):
            node = self.client.get_node_from_key(key)
            groups.setdefault(node.name, (node, []))[1].append(index)
        replies: list[Any] = [None] * len(commands)

        def one(node: Any, indexes: list[int]) -> None:
            connection = self.client.get_redis_connection(node)
            answers = _pipeline(connection, [commands[i] for i in indexes])
            for index, answer in zip(indexes, answers, strict=True):
                replies[index] = answer

        shares = list(groups.values())
        if len(shares) == 1:
            one(*shares[0])
        else:
            for future in [self._pool.submit(one, node, indexes) for node, indexes in shares]:
                future.result()
        return replies

    def failed(self, *, force: bool = False) -> None:
        """A read failed: read the slot map again (at most once a second unless `force`), so
        the next reads go where a failover put the slots."""
        if not self.clustered:
            return
        with self._lock:
            now = time.monotonic()
            if not force and now - self._refreshed_at < REFRESH_SECONDS:
                return
            self._refreshed_at = now
        # No node answering yet is no matter: the next failure tries again.
        with contextlib.suppress(redis.RedisError, redis.exceptions.RedisClusterException, OSError):
            self.client.nodes_manager.initialize()

    def close(self) -> None:
        """Stop the threads and close the connections."""
        self._pool.shutdown(wait=False)
        self.client.close()


def _pipeline(connection: Any, commands: list[Command]) -> list[Any]:
    pipe = connection.pipeline(transaction=False)
    for method, key, args in commands:
        getattr(pipe, method)(key, *args)
    return list(pipe.execute(raise_on_error=True))
