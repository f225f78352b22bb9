"""The eviction index: unpinned leaf blocks, ordered by the rank their policy gave them."""

from __future__ import annotations

import struct

from cache_service.core.blocks import BlockMeta, StoreKey
from cache_service.core.eviction import EvictionPolicy
from cache_service.core.store.parts.backend import VICTIMS, Txn

_PRIORITY = struct.Struct(">Q")


class VictimIndex:
    """Where the policy ranks each evictable block; only unpinned leaves are listed."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy

    def position(self, meta: BlockMeta) -> bytes | None:
        """The block's sort key while it is an unpinned leaf, else None (taken before the
        block changes, to move its entry after)."""
        if meta.children or meta.pinned:
            return None
        return _PRIORITY.pack(meta.eviction_rank)

    @staticmethod
    def move(txn: Txn, key: StoreKey, before: bytes | None, after: bytes | None) -> None:
        """Move a block's entry from `before` to `after` (None: not listed)."""
        if before is not None:
            txn.index_remove(VICTIMS, before, key)
        if after is not None:
            txn.index_add(VICTIMS, after, key)

    def child_removed(self, parent: BlockMeta, child: BlockMeta) -> None:
        """Let the policy carry what it ranks by from a removed child to its parent."""
        self.policy.child_removed(parent, child)
