"""Eviction policies: which evictable (leaf) block goes first.

The store keeps its leaf blocks in an index ordered by `priority(meta)`, lowest first, and
evicts from the front. A policy sees only a block's metadata, so any backend (memory, LMDB,
Redis) and the replay tool share the same policy objects.
"""

from __future__ import annotations

from typing import Protocol

from cache_service.blocks import BlockMeta

MAX_PRIORITY = 2**64 - 1


class EvictionPolicy(Protocol):
    """Orders evictable blocks: the block with the lowest priority is evicted first."""

    name: str

    def priority(self, meta: BlockMeta) -> int:
        """An unsigned 64-bit sort key; it may change whenever the block is used."""
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


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LruPolicy}


def make_policy(name: str) -> EvictionPolicy:
    """The policy called `name`; ValueError for an unknown one."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r} (known: {', '.join(POLICIES)})"
        ) from None
