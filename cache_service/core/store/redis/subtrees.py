"""The blocks stored under one block on the Redis store, found without a child index: a SCAN
of the tenant's block keys on every primary reads each block's namespace root and parent
(32 bytes of its record), and the subtree is walked from those parent links. A purge under a
prefix or a removal costs a pass over the tenant's keys; lookups and stores pay nothing for it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from cache_service.core.blocks import KEY_BYTES, BlockKey, StoreKey, store_key
from cache_service.core.store.parts.codec import PARENT_END, ROOT_AT
from cache_service.core.store.redis.values import BLOCK_PREFIX, LENGTH, glob_escape

SCAN_BATCH = 1000


def scan(node: Any, pattern: bytes) -> Iterator[list[bytes]]:
    """The keys matching `pattern` on one node, a batch at a time."""
    cursor = 0
    while True:
        cursor, found = node.scan(cursor, match=pattern, count=SCAN_BATCH)
        if found:
            yield list(found)
        if cursor == 0:
            return


def tenant_blocks(node: Any, partition: bytes) -> Iterator[list[bytes]]:
    """The Redis keys of a tenant's blocks on one node (not a longer partition's), a batch
    at a time."""
    length = len(BLOCK_PREFIX) + len(partition) + KEY_BYTES
    for batch in scan(node, BLOCK_PREFIX + glob_escape(partition) + b"*"):
        mine = [key for key in batch if len(key) == length]
        if mine:
            yield mine


def subtree(
    nodes: list[Any], partition: bytes, root: BlockKey | None, top: BlockKey
) -> list[tuple[StoreKey, BlockKey]]:
    """`top` and every block of its namespace (of any, when `root` is None: a damaged
    record's root cannot be trusted) stored under it, parents before children, each with
    its parent's hash; empty when `top` is not stored."""
    children: dict[bytes, list[bytes]] = defaultdict(list)
    present = False
    start = len(BLOCK_PREFIX) + len(partition)
    for node in nodes:
        for batch in tenant_blocks(node, partition):
            pipe = node.pipeline(transaction=False)
            for key in batch:
                pipe.getrange(key, LENGTH.size + ROOT_AT, LENGTH.size + PARENT_END - 1)
            for key, held in zip(batch, pipe.execute(raise_on_error=False), strict=True):
                if not isinstance(held, bytes) or (root is not None and held[:KEY_BYTES] != root):
                    continue
                block = key[start:]
                present = present or block == top
                children[held[KEY_BYTES:]].append(block)
    if not present:
        return []
    parent_of = {child: parent for parent, kids in children.items() for child in kids}
    order: list[tuple[StoreKey, BlockKey]] = []
    queue = [bytes(top)]
    while queue:
        block = queue.pop()
        order.append((store_key(partition, BlockKey(block)), BlockKey(parent_of[block])))
        queue += children.get(block, [])
    return order
