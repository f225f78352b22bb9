"""Least recently used: a block's rank is the sequence number of its last use."""

from __future__ import annotations

from cache_service.core.blocks import BlockMeta
from cache_service.core.eviction.base import Use, inherit_use


class LruPolicy:
    """Least recently used first, by the store's use sequence number.

    A use is recorded on the deepest block it reached, and a removed child's rank passes
    to its parent: when a block becomes a leaf its rank is that of the last use of its
    prefix, so leaf-only LRU evicts exactly as per-block LRU would. Cost: O(1) per use, no
    memory beyond the record."""

    name = "lru"

    def rank(self, meta: BlockMeta, *, seq: int, use: Use) -> int:
        """The use's sequence number."""
        return seq

    def child_removed(self, parent: BlockMeta, child: BlockMeta) -> None:
        """The parent takes over its child's record of use (rank, last use, hits)."""
        inherit_use(parent, child)

    def evicted(self, meta: BlockMeta, *, held_blocks: int) -> None:
        """LRU learns nothing from an eviction."""

    def begin(self) -> None:
        """LRU keeps no state of its own."""

    def commit(self) -> None:
        """Nothing to keep."""

    def abort(self) -> None:
        """Nothing to undo."""
