"""Eviction policies: which evictable (leaf) block goes first.

The store keeps its leaf blocks in an index ordered by `priority(meta)`, lowest first, and
evicts from the front. A policy sees only a block's metadata, so any backend (memory, LMDB,
Redis) and the replay tool share the same policy objects. Only leaves are listed: when a
child is removed, the policy decides what of its record its parent takes over.
"""

from __future__ import annotations

from typing import Protocol

from cache_service.core.blocks import BlockMeta

MAX_PRIORITY = 2**64 - 1


class EvictionPolicy(Protocol):
    """Orders evictable blocks: the block with the lowest priority is evicted first."""

    name: str

    def priority(self, meta: BlockMeta) -> int:
        """An unsigned 64-bit sort key; it may change whenever the block is used."""
        ...

    def child_removed(self, parent: BlockMeta, child: BlockMeta) -> None:
        """Update `parent` (written by the store after) for the removal of `child`."""
        ...


class LruPolicy:
    """Least recently used first, by the store's use sequence number.

    A use is recorded on the deepest block it reached, and a removed child's sequence
    passes to its parent: when a block becomes a leaf its sequence is that of the last use
    of its prefix, so leaf-only LRU evicts exactly as per-block LRU would.
    """

    name = "lru"

    def priority(self, meta: BlockMeta) -> int:
        """The block's last-use sequence number."""
        return meta.lru_seq

    def child_removed(self, parent: BlockMeta, child: BlockMeta) -> None:
        """The parent takes over its child's record of use (sequence, last use, hits)."""
        # Uses are recorded on a hit's deepest block only: when the parent becomes a leaf it
        # then ranks as if every use had marked it too.
        parent.lru_seq = max(parent.lru_seq, child.lru_seq)
        parent.last_used_at = max(parent.last_used_at, child.last_used_at)
        parent.hits += child.hits


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LruPolicy}


def make_policy(name: str) -> EvictionPolicy:
    """The policy called `name`; ValueError for an unknown one."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r} (known: {', '.join(POLICIES)})"
        ) from None
