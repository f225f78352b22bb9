"""Protected LRU: a block a second request has used stays one eviction horizon longer.

On the public traces most stored blocks are never used again, while a block that has been
used twice is used again about twice as often as a new one. LRU gives both the same time
in the cache: its eviction horizon, how far back in uses the cache's evictions reach. This
policy gives a reused block that horizon twice. Nothing in it is tuned to a trace: the
horizon is measured from the store's own evictions (it grows with the capacity and shrinks
with the load), and before any eviction it is zero, so the policy is then exactly LRU.
"""

from __future__ import annotations

from typing import Any

from cache_service.core.blocks import BlockMeta
from cache_service.core.eviction.base import Use, inherit_use
from cache_service.core.eviction.ghost import GHOST_FLOOR, Ghost

# The ghost remembers evicted blocks, so one stored again counts as reused. It holds twice
# the blocks the store holds (a block asked for again after two cache turnovers would not
# have survived a second life either), and at least GHOST_FLOOR.
GHOST_PER_HELD_BLOCK = 2


class ProtectedPolicy:
    """Rank = the use's sequence number, plus the current eviction horizon for a block
    that more than one request has used (hit, stored again, or stored again after it was
    evicted); a use never lowers a rank. Cost: O(1) per use and per eviction; memory: a
    bounded ghost of evicted keys (about 150 bytes each in Python, at most two per block
    held)."""

    name = "protected"

    def __init__(self) -> None:
        # Where eviction stands: the highest rank evicted to make room, but never past the
        # newest use (a protected block's rank runs ahead of the sequence).
        self._frontier = 0
        self._newest = 0  # the newest use's sequence number seen
        self._ghost = Ghost()
        self._saved: Any = None

    def horizon(self, seq: int) -> int:
        """How many uses back eviction reaches at use `seq` (0 before the first eviction)."""
        if not self._frontier:
            return 0
        return max(seq - self._frontier, 0)

    def rank(self, meta: BlockMeta, *, seq: int, use: Use) -> int:
        """`seq`, plus the protection once a second request has used the block; never
        below the rank the block has (a use does not make it less worth keeping)."""
        self._newest = max(self._newest, seq)
        reused = use is not Use.STORED or meta.hits > 0
        if use is Use.STORED:
            self.stored_once()
            was_hit = self._ghost.take(meta.key)
            if was_hit is not None:  # evicted, and asked for again
                self.ghost_hit(was_hit)
                reused = True
        new = seq + self.protection(seq) if reused else seq
        return max(new, meta.eviction_rank)

    def protection(self, seq: int) -> int:
        """What a reused block gets over a new one at use `seq`: one eviction horizon."""
        return self.horizon(seq)

    def stored_once(self) -> None:
        """A block was stored (a subclass may count turnovers)."""

    def ghost_hit(self, was_hit: bool) -> None:
        """A block evicted after being hit (or not) was stored again (a subclass learns)."""

    def child_removed(self, parent: BlockMeta, child: BlockMeta) -> None:
        """The parent takes over its child's record of use (rank, last use, hits)."""
        inherit_use(parent, child)

    def evicted(self, meta: BlockMeta, *, held_blocks: int) -> None:
        """Move the frontier and remember the block in the ghost, with whether it had been
        hit (a block stored again is not marked: its record keeps verified hits only)."""
        self._frontier = max(self._frontier, min(meta.eviction_rank, self._newest))
        self._ghost.limit = max(GHOST_FLOOR, GHOST_PER_HELD_BLOCK * held_blocks)
        self._ghost.add(meta.key, meta.hits > 0)

    def ghost_size(self) -> int:
        """Evicted keys remembered now."""
        return len(self._ghost)

    # -- a write transaction's changes: kept on commit, undone on abort -------------------

    def begin(self) -> None:
        """A write transaction begins: note the state it may change."""
        self._saved = self._state()
        self._ghost.mark()

    def commit(self) -> None:
        """The transaction committed: keep what it taught."""
        self._saved = None
        self._ghost.settle()

    def abort(self) -> None:
        """The transaction aborted: forget what it taught (it did not happen)."""
        if self._saved is not None:
            self._restore(self._saved)
        self._saved = None
        self._ghost.undo()

    def _state(self) -> Any:
        return (self._frontier, self._newest, self._ghost.limit)

    def _restore(self, state: Any) -> None:
        self._frontier, self._newest, self._ghost.limit = state
