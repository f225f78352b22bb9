"""Which blocks a purge or a subtree removal deletes: read in short transactions, ordered
deepest first, so that deleting them in that order keeps the store prefix-closed."""

from __future__ import annotations

from typing import NamedTuple

from cache_service.core.blocks import BlockKey, StoreKey
from cache_service.core.store.txns import Transactions

SCAN_BATCH_BLOCKS = 4096


class Target(NamedTuple):
    """A block to delete."""

    key: StoreKey
    depth: int
    parent_key: StoreKey


def find(
    txns: Transactions,
    partition: bytes,
    *,
    root: BlockKey | None = None,
    under: StoreKey | None = None,
) -> list[Target]:
    """A tenant's blocks (of namespace `root` only, if given; only `under` and its
    descendants, if given), deepest first. Each batch is read in its own short transaction,
    so the answer is a snapshot: its blocks may have changed by the time they are deleted."""
    found: list[Target] = []
    after: bytes | None = None
    while True:
        with txns.read() as txn:
            batch = txn.scan_blocks(partition, after, SCAN_BATCH_BLOCKS)
        if not batch:
            break
        found += [
            Target(meta.key, meta.depth, meta.parent_key)
            for meta in batch
            if root is None or meta.namespace_root == root
        ]
        after = batch[-1].key
    if under is not None:
        found = _subtree(found, under)
    found.sort(key=lambda target: -target.depth)  # children before parents
    return found


def _subtree(found: list[Target], under: StoreKey) -> list[Target]:
    """`under` and its descendants among `found`."""
    children: dict[bytes, list[Target]] = {}
    for target in found:
        if target.depth:
            children.setdefault(target.parent_key, []).append(target)
    start = next((target for target in found if target.key == under), None)
    subtree = [start] if start is not None else []
    for target in subtree:  # grows as it goes: a breadth-first walk
        subtree += children.get(target.key, [])
    return subtree
