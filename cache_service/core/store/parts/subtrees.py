"""Which blocks a purge or a subtree removal deletes: read in short transactions, ordered
deepest first, so that deleting them in that order keeps the store prefix-closed.

A damaged record is skipped by the scan (and noted as damaged by it); the blocks under it are
still found, by their own parent keys."""

from __future__ import annotations

from typing import NamedTuple

from cache_service.core.blocks import BlockKey, StoreKey
from cache_service.core.store.parts.txns import Transactions

REMOVE_BATCH_BLOCKS = 1024  # blocks deleted per write transaction: writers never wait long

SCAN_BATCH_BLOCKS = 4096


class Target(NamedTuple):
    """A block to delete."""

    key: StoreKey
    depth: int
    parent_key: StoreKey
    children: int = 0  # as the block's record counts them
    root: bytes = b""  # its namespace root


def find(
    txns: Transactions,
    partition: bytes,
    *,
    root: BlockKey | None = None,
    under: StoreKey | None = None,
) -> list[Target]:
    """A tenant's blocks (of namespace `root` only, if given; only `under` and its
    descendants, if given: its descendants alone if its own record is gone or damaged),
    deepest first. Each batch is read in its own short transaction, so the answer is a
    snapshot: its blocks may have changed by the time they are deleted."""
    found = scan(txns, partition)
    if root is not None:
        found = [target for target in found if target.root == root]
    if under is not None:
        found = subtree(found, under)
    found.sort(key=lambda target: -target.depth)  # children before parents
    return found


def scan(txns: Transactions, partition: bytes) -> list[Target]:
    """Every readable block of a tenant, in key order, read in short transactions."""
    found: list[Target] = []
    after: bytes | None = None
    while True:
        with txns.read() as txn:
            batch = txn.scan_blocks(partition, after, SCAN_BATCH_BLOCKS)
        if not batch:
            break
        found += [
            Target(meta.key, meta.depth, meta.parent_key, meta.children, meta.namespace_root)
            for meta in batch
        ]
        after = batch[-1].key
    return found


def children_of(found: list[Target]) -> dict[bytes, list[Target]]:
    """The blocks among `found` by their parent's key (built once for many `subtree` calls)."""
    children: dict[bytes, list[Target]] = {}
    for target in found:
        if target.depth:
            children.setdefault(target.parent_key, []).append(target)
    return children


def subtree(
    found: list[Target], under: StoreKey, children: dict[bytes, list[Target]] | None = None
) -> list[Target]:
    """`under` (if it is among `found`) and its descendants among `found`, parents first;
    `children` is `children_of(found)` when the caller has it already."""
    if children is None:
        children = children_of(found)
    result = [target for target in found if target.key == under][:1]
    result += children.get(under, [])
    seen = {target.key for target in result} | {under}
    at = 0
    while at < len(result):  # breadth first; `seen` guards against a record its own parent
        for child in children.get(result[at].key, []):
            if child.key not in seen:
                seen.add(child.key)
                result.append(child)
        at += 1
    return result
