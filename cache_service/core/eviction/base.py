"""What every eviction policy provides: a rank per block, set at each use, lowest evicted first."""

from __future__ import annotations

import enum
from typing import Protocol

from cache_service.core.blocks import BlockMeta


class Use(enum.Enum):
    """Why a block's rank is being set."""

    STORED = "stored"  # written now (new, or in place of an expired copy)
    REFRESHED = "refreshed"  # stored again while alive: another request brought it
    HIT = "hit"  # a verified hit ended on it (the deepest block of the hit)


class EvictionPolicy(Protocol):
    """Ranks evictable blocks: the store evicts the unpinned leaf of lowest rank first.

    A rank is an unsigned 64-bit number the store keeps in the block's record
    (`eviction_rank`) and its victims index; the policy sets it at each use from the use's
    sequence number (one counter for every write and hit of the store, so ranks never
    depend on a wall clock and a replay reproduces the service's order exactly). Only
    leaves are listed: when a child is removed, the policy decides what of its record the
    parent takes over."""

    name: str

    def rank(self, meta: BlockMeta, *, seq: int, use: Use) -> int:
        """The block's rank after a use numbered `seq` (the store writes it)."""
        ...

    def child_removed(self, parent: BlockMeta, child: BlockMeta) -> None:
        """Update `parent` (written by the store after) for the removal of `child`."""
        ...

    def evicted(self, meta: BlockMeta, *, held_blocks: int) -> None:
        """A block left to make room (not expired, purged or removed on request);
        `held_blocks` is about how many the store holds now."""
        ...

    def begin(self) -> None:
        """A write transaction begins (the store calls `rank` and `evicted` only inside one)."""
        ...

    def commit(self) -> None:
        """The transaction committed: what the policy saw in it happened."""
        ...

    def abort(self) -> None:
        """The transaction aborted: undo what the policy learned in it."""
        ...


def inherit_use(parent: BlockMeta, child: BlockMeta) -> None:
    """The parent takes over its removed child's record of use (rank, last use, hits).

    Uses are recorded on a hit's deepest block only: when the parent becomes a leaf it then
    ranks as if every use of its subtree had marked it too."""
    parent.eviction_rank = max(parent.eviction_rank, child.eviction_rank)
    parent.last_used_at = max(parent.last_used_at, child.last_used_at)
    parent.hits += child.hits
