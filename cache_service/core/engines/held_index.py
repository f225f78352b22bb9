"""Which (engine, rank, group, medium) slots hold each block: one bitmask per block hash.

Every slot (one set of blocks of one engine's view) gets a bit the first time it stores a
block; a block's mask has the bits of the slots holding it. One walk answers a prompt for
every engine at once: the masks of the chain's blocks, AND-accumulated from the first, say at
each depth which slots hold the whole prefix so far. The accumulated masks only lose bits as
the depth grows, so each slot's count of leading blocks is a binary search over them. For a
32k-token prompt (2,048 blocks) against 16 engines that is two C-level passes over the chain
plus a few dozen probes, instead of one set look-up per block per engine.

A block is held by someone exactly when it has a mask (zero masks are deleted), which is what
`held_prefix` needs: no engine's prefix can reach past a block nobody holds.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from itertools import accumulate, repeat, takewhile
from operator import and_

from cache_service.core.engines.block_hashes import EngineBlockHash

Slot = tuple[str, int, int, str]  # (engine, data-parallel rank, group, medium)


class HeldIndex:
    """Block hash -> bitmask of the slots holding it, with the slots' bit numbers."""

    def __init__(self) -> None:
        self._masks: dict[EngineBlockHash, int] = {}
        self._bits: dict[Slot, int] = {}

    def __len__(self) -> int:
        return len(self._masks)

    def __contains__(self, block: object) -> bool:
        return block in self._masks

    def bit(self, slot: Slot) -> int:
        """The slot's bit (a power of two), numbered densely in order of first use. A slot
        keeps its bit for the index's life: slots are few (engines x ranks x groups x media)."""
        number = self._bits.get(slot)
        if number is None:
            number = self._bits[slot] = len(self._bits)
        return 1 << number

    def add(self, block: EngineBlockHash, bit: int) -> None:
        """Mark `block` held by the slot of `bit` (the caller adds each block once per slot)."""
        self._masks[block] = self._masks.get(block, 0) | bit

    def discard(self, block: EngineBlockHash, bit: int) -> None:
        """Mark `block` no longer held by the slot of `bit`."""
        mask = self._masks.get(block, 0) & ~bit
        if mask:
            self._masks[block] = mask
        else:
            self._masks.pop(block, None)

    def held_prefix(self, chain: Sequence[EngineBlockHash]) -> int:
        """How many leading blocks of `chain` some slot holds."""
        return len(list(takewhile(self._masks.__contains__, chain)))

    def prefix_masks(self, chain: Sequence[EngineBlockHash]) -> list[int]:
        """For each depth d, the bits of the slots holding all of `chain[: d + 1]`; cut at
        the first depth where none does."""
        masks = map(self._masks.get, chain, repeat(0))
        return list(takewhile(bool, accumulate(masks, and_)))


def leading_count(prefix_masks: list[int], bit: int) -> int:
    """How many leading blocks the slot of `bit` holds, given `HeldIndex.prefix_masks`."""
    if not prefix_masks or not prefix_masks[0] & bit:
        return 0
    if prefix_masks[-1] & bit:
        return len(prefix_masks)
    return bisect_left(prefix_masks, True, key=lambda mask: not mask & bit)
