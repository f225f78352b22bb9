"""Stores and hits on the Redis store: each block put-if-absent with its class TTL (SET NX
PX), tried again through a failover, refused behind a circuit breaker past that; a hit slides
the whole prefix's expiry (PEXPIRE GT)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from typing import Any

from cache_service.core.blocks import (
    BlockMeta,
    ChainLink,
    InsertResult,
    NamespaceId,
    NewBlock,
    Touch,
    store_key,
)
from cache_service.core.errors import MissingParent, StorageFailure, StoreFull
from cache_service.core.store.parts.codec import (
    COLLISION,
    HIT,
    TOKENS_AT,
    checksum,
    decode_meta,
)
from cache_service.core.store.redis.breaker import CircuitBreaker
from cache_service.core.store.redis.fanout import Command, Fanout, command
from cache_service.core.store.redis.values import (
    LENGTH,
    RETENTION_SLACK,
    block_key,
    is_out_of_memory,
    is_redis_error,
    link_verdict,
    namespace_key,
    pack_value,
    record_of,
)

WRITE_RETRY_SECONDS = 5.0  # covers a failover at cluster-node-timeout 1-2 s, not at 15 s


class RedisWrites:
    """insert and touch (mixed into RedisStore)."""

    client: Any
    reads: Fanout  # lookups' reads, also the touches' (a failure is forgotten)
    breaker: CircuitBreaker
    write_retry_seconds: float
    write_retries: int
    write_failures: int
    touch_errors: int
    _lock: threading.Lock

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
            verdict = link_verdict(record, namespace, parent, now)
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
            for index in existing:  # their records only: the conflict check needs no payload
                last = LENGTH.size + TOKENS_AT + RETENTION_SLACK + len(blocks[index].link.tokens)
                pipe.getrange(block_key(keys[index]), 0, last - 1)
                pipe.pexpire(block_key(keys[index]), ttl_ms, gt=True)
            values = pipe.execute(raise_on_error=True)[::2]
            for index, value in zip(existing, values, strict=True):
                link = blocks[index].link
                record, _ = record_of(self.client, keys[index], value, whole=False)
                verdict = link_verdict(record, namespace, link, now)
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
        )

    def touch(
        self,
        touches: Sequence[Touch],
        *,
        resolution_seconds: float = 0.0,
        slide_fraction: float = 0.0,
    ) -> None:
        """Slide the expiry of each hit's blocks (PEXPIRE GT) that would move by more than
        the resolution and `slide_fraction` of the TTL: one PTTL round trip for every block
        of the hits (an early block stored long ago may be nearer its end than the deepest),
        one for the slides, both sent as the lookups' reads are (fanout.py: a 32k prompt's
        512 PTTLs took 4.5 ms of Python in redis-py's cluster pipeline). A failure is
        forgotten (a hit is not a write)."""
        hits = [hit for hit in touches if hit.keys]
        if not hits:
            return
        try:
            keys = [[block_key(store_key(hit.partition, key)) for key in hit.keys] for hit in hits]
            left = iter(
                self.reads.run([command(b"PTTL", key) for hit_keys in keys for key in hit_keys])
            )
            slides: list[Command] = []
            for hit, hit_keys in zip(hits, keys, strict=True):
                ttl_ms = math.ceil(hit.ttl_seconds * 1000)
                slide = b"%d" % ttl_ms
                slack_ms = 1000 * max(resolution_seconds, hit.ttl_seconds * slide_fraction)
                # `left` is shared: zip takes from it exactly one answer per key of this hit.
                for key, ttl_left_ms in zip(hit_keys, left, strict=False):
                    # Gone, kept without expiry (pinned), or slid recently enough: left be.
                    if ttl_left_ms >= 0 and ttl_ms - ttl_left_ms > slack_ms:
                        slides.append(command(b"PEXPIRE", key, slide, b"GT"))
            if slides:
                self.reads.run(slides)
        except Exception as exc:
            if not is_redis_error(exc):
                raise
            with self._lock:
                self.touch_errors += 1
