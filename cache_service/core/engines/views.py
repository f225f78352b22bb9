"""Which blocks each engine holds, per data-parallel rank, KV-cache group and medium.

The views follow the engines' KV events: a store adds (or refreshes) a block, a removal drops
it from the medium it names, a clear empties the rank. Only full-attention groups are
indexed (``kv_cache_spec_kind`` absent or ``full_attention``): a sliding-window group's
blocks do not make a prefix reusable, and the same hash appears in every group of a hybrid
model, so each group is its own set and a removal from one never touches another.

Memory is bounded per engine: at most ``max_blocks_per_engine`` (rank, group, block, medium)
entries, the least recently stored dropped first and counted. A query answers, for a
prompt's chain of engine hashes, how many leading blocks each engine holds per medium.
One lock serialises the subscriber's writes and the router's reads.

Beside the per-engine sets, `EngineViews` keeps a `HeldIndex` over all engines: per block
hash, a bitmask of the (engine, rank, group, medium) slots holding it (held_index.py). A
query walks the chain once for every engine (its masks AND-accumulated), and the router
stops hashing a prompt at the first block nobody holds (`held_prefix`), since no engine's
prefix can reach past it. The index is kept on every store, removal, clear, drop and
forgotten group, so it is bounded by the views' own entries: one dict slot per distinct
block.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from cache_service.core.engines.block_hashes import EngineBlockHash
from cache_service.core.engines.decoding import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
)
from cache_service.core.engines.held_index import HeldIndex, leading_count

FULL_ATTENTION = "full_attention"
GPU, CPU, DISK = "GPU", "CPU", "DISK"
_MEDIUM_ALIASES = {
    "GPU": GPU,
    "CPU": CPU,
    "CPU_PINNED": CPU,  # SGLang's host (L2) tier
    "CPU_TIER1": CPU,  # SGLang's names before StorageMedium
    "CPU_TIER2": DISK,
    "DISK": DISK,
}

_Entry = tuple[int, int, EngineBlockHash, str]  # (rank, group, block, medium)


def normalize_medium(medium: str | None) -> str:
    """GPU, CPU or DISK for the names engines use; an event without one is the GPU cache."""
    if medium is None:
        return GPU
    upper = medium.upper()
    return _MEDIUM_ALIASES.get(upper, upper)


@dataclass(frozen=True, slots=True)
class PrefixHold:
    """How many leading blocks of a chain an engine holds in one medium (its best rank)."""

    engine: str
    medium: str
    blocks: int
    data_parallel_rank: int
    stale: bool


@dataclass(slots=True)
class Applied:
    """What applying events changed: blocks added, refreshed, removed, dropped, ignored."""

    stored: int = 0
    refreshed: int = 0
    removed: int = 0
    cleared: int = 0
    dropped: int = 0
    ignored: int = 0  # blocks of groups that are not full attention

    def add(self, other: Applied) -> None:
        """Add another result's counts to this one."""
        self.stored += other.stored
        self.refreshed += other.refreshed
        self.removed += other.removed
        self.cleared += other.cleared
        self.dropped += other.dropped
        self.ignored += other.ignored


@dataclass(slots=True)
class _Rank:
    groups: dict[int, dict[str, set[EngineBlockHash]]] = field(default_factory=dict)
    other_groups: set[int] = field(default_factory=set)  # learned not to be full attention
    stale: bool = False
    down: bool = False  # its publisher went away


class EngineView:
    """One engine's blocks over all its ranks, bounded with LRU by last store."""

    def __init__(self, name: str, *, max_blocks: int, index: HeldIndex | None = None) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.name = name
        self.max_blocks = max_blocks
        self.dropped_total = 0
        self._ranks: dict[int, _Rank] = {}
        self._lru: OrderedDict[_Entry, None] = OrderedDict()
        # Which slots hold each block, over every view sharing it (EngineViews passes its own).
        self._index = HeldIndex() if index is None else index

    def __len__(self) -> int:
        return len(self._lru)

    def apply(self, rank: int, event: KVEvent) -> Applied:
        """Apply one event of the given rank."""
        state = self._ranks.setdefault(rank, _Rank())
        if isinstance(event, BlockStored):
            return self._store(rank, state, event)
        if isinstance(event, BlockRemoved):
            return self._remove(rank, state, event)
        if isinstance(event, AllBlocksCleared):
            return Applied(cleared=self.reset(rank))
        raise TypeError(f"not a KV event: {event!r}")

    def reset(self, rank: int) -> int:
        """Forget every block of a rank (a clear, or its publisher restarted); count them."""
        state = self._ranks.get(rank)
        if state is None:
            return 0
        entries = [entry for entry in self._lru if entry[0] == rank]
        for entry in entries:
            del self._lru[entry]
            self._release(entry)
        state.groups.clear()
        state.other_groups.clear()
        return len(entries)

    def set_stale(self, rank: int, stale: bool) -> None:
        """Mark a rank's view as possibly wrong (events were lost) or as sound again."""
        self._ranks.setdefault(rank, _Rank()).stale = stale

    def stale_ranks(self) -> set[int]:
        """The ranks whose views may miss events."""
        return {rank for rank, state in self._ranks.items() if state.stale}

    def set_down(self, rank: int, down: bool) -> None:
        """Mark a rank whose publisher went away (its blocks count only while no rank of the
        engine is up), or back."""
        self._ranks.setdefault(rank, _Rank()).down = down

    def holds(self, rank: int, group: int, block: EngineBlockHash, medium: str = GPU) -> bool:
        """Whether a rank's group holds a block in a medium."""
        state = self._ranks.get(rank)
        media = state.groups.get(group, {}) if state else {}
        return block in media.get(normalize_medium(medium), ())

    def leading(self, prefix_masks: list[int]) -> list[PrefixHold]:
        """Per medium, the most leading blocks of a chain any rank holds, given the chain's
        `HeldIndex.prefix_masks`."""
        best: dict[str, PrefixHold] = {}
        # A rank that went away may no longer hold its blocks: while another rank of the
        # engine is up, only the ranks that are up count (an engine wholly down keeps its
        # rows, ranked last by routing, until the grace leaves it out).
        skip_down = any(not state.down for state in self._ranks.values())
        for rank, state in self._ranks.items():
            if not state.groups or (skip_down and state.down):
                continue
            media = {medium for groups in state.groups.values() for medium in groups}
            for medium in media:
                # A block serves a prefix only if every full-attention group holds it.
                count = min(
                    leading_count(prefix_masks, self._bit(rank, group, medium))
                    if medium in groups
                    else 0
                    for group, groups in state.groups.items()
                )
                held = best.get(medium)
                if count and (held is None or count > held.blocks):
                    best[medium] = PrefixHold(self.name, medium, count, rank, state.stale)
        return sorted(best.values(), key=lambda hold: hold.medium)

    def _bit(self, rank: int, group: int, medium: str) -> int:
        return self._index.bit((self.name, rank, group, medium))

    def _store(self, rank: int, state: _Rank, event: BlockStored) -> Applied:
        group = event.group_idx or 0
        result = Applied()
        if event.kv_cache_spec_kind not in (None, FULL_ATTENTION):
            if group not in state.other_groups:
                state.other_groups.add(group)
                self._forget_group(rank, state, group)
            result.ignored = len(event.block_hashes)
            return result
        if group in state.other_groups:
            result.ignored = len(event.block_hashes)
            return result
        medium = normalize_medium(event.medium)
        blocks = state.groups.setdefault(group, {}).setdefault(medium, set())
        bit, index = self._bit(rank, group, medium), self._index
        for block in event.block_hashes:
            entry = (rank, group, block, medium)
            if entry in self._lru:
                self._lru.move_to_end(entry)
                result.refreshed += 1
            else:
                self._lru[entry] = None
                blocks.add(block)
                index.add(block, bit)
                result.stored += 1
        while len(self._lru) > self.max_blocks:
            self._drop_oldest()
            result.dropped += 1
        return result

    def _remove(self, rank: int, state: _Rank, event: BlockRemoved) -> Applied:
        group = event.group_idx or 0
        medium = normalize_medium(event.medium)
        blocks = state.groups.get(group, {}).get(medium)
        result = Applied()
        if blocks is None:
            return result
        for block in event.block_hashes:
            if block in blocks:
                blocks.discard(block)
                entry = (rank, group, block, medium)
                del self._lru[entry]
                self._release(entry)
                result.removed += 1
        return result

    def _drop_oldest(self) -> None:
        entry, _ = self._lru.popitem(last=False)
        rank, group, block, medium = entry
        self._ranks[rank].groups[group][medium].discard(block)
        self._release(entry)
        self.dropped_total += 1

    def _release(self, entry: _Entry) -> None:
        rank, group, block, medium = entry
        self._index.discard(block, self._bit(rank, group, medium))

    def _forget_group(self, rank: int, state: _Rank, group: int) -> None:
        # A group indexed before its kind was known (older events carry none) is dropped
        # whole once a store says it is not full attention.
        if state.groups.pop(group, None) is not None:
            for entry in [entry for entry in self._lru if entry[:2] == (rank, group)]:
                del self._lru[entry]
                self._release(entry)


class EngineViews:
    """Every engine's view, safe to update from the subscriber while the router reads."""

    def __init__(self, *, max_blocks_per_engine: int) -> None:
        self.max_blocks_per_engine = max_blocks_per_engine
        self._views: dict[str, EngineView] = {}
        self._index = HeldIndex()  # which views' slots hold each block
        self._lock = threading.Lock()

    def engines(self) -> list[str]:
        """The names of the engines with a view."""
        with self._lock:
            return sorted(self._views)

    def apply_batch(self, engine: str, rank: int, batch: EventBatch) -> Applied:
        """Apply one decoded batch of an engine's rank."""
        return self.apply_events(engine, rank, batch.events)

    def apply_events(self, engine: str, rank: int, events: Iterable[KVEvent]) -> Applied:
        """Apply events of an engine's rank in order."""
        total = Applied()
        with self._lock:
            view = self._view(engine)
            for event in events:
                total.add(view.apply(rank, event))
        return total

    def reset(self, engine: str, rank: int) -> int:
        """Forget a rank's blocks (its publisher restarted); the number forgotten."""
        with self._lock:
            return self._view(engine).reset(rank)

    def set_stale(self, engine: str, rank: int, stale: bool) -> None:
        """Mark an engine's rank stale (events lost and not replayed) or sound."""
        with self._lock:
            self._view(engine).set_stale(rank, stale)

    def set_down(self, engine: str, rank: int, down: bool) -> None:
        """Mark an engine's rank as gone away (disconnected, silent) or back."""
        with self._lock:
            self._view(engine).set_down(rank, down)

    def is_stale(self, engine: str) -> bool:
        """Whether any rank of the engine may miss events."""
        with self._lock:
            view = self._views.get(engine)
            # A view holding no blocks is falsy (len 0): test for absence, not truth.
            return view is not None and bool(view.stale_ranks())

    def block_count(self, engine: str) -> int:
        """How many (rank, group, block, medium) entries an engine's view holds."""
        with self._lock:
            view = self._views.get(engine)
            return len(view) if view is not None else 0

    def dropped_total(self, engine: str) -> int:
        """How many entries the bound has dropped from an engine's view."""
        with self._lock:
            view = self._views.get(engine)
            return view.dropped_total if view is not None else 0

    def holds(
        self, engine: str, rank: int, group: int, block: EngineBlockHash, medium: str = GPU
    ) -> bool:
        """Whether an engine's rank and group holds a block in a medium."""
        with self._lock:
            view = self._views.get(engine)
            return view is not None and view.holds(rank, group, block, medium)

    def held_prefix(self, chain: Sequence[EngineBlockHash]) -> int:
        """How many leading blocks of `chain` some engine holds (any rank, group, medium):
        no engine's `match_prefix` can count more."""
        with self._lock:
            return self._index.held_prefix(chain)

    def held_blocks(self) -> int:
        """How many distinct blocks the views hold over all engines."""
        with self._lock:
            return len(self._index)

    def match_prefix(
        self, chain: Sequence[EngineBlockHash], *, engines: Iterable[str] | None = None
    ) -> list[PrefixHold]:
        """Per (engine, medium) holding at least one leading block: how many it holds."""
        with self._lock:
            names = self._views if engines is None else engines
            prefix_masks = self._index.prefix_masks(chain)  # once for every engine
            holds: list[PrefixHold] = []
            for name in names:
                view = self._views.get(name)
                if view is not None:
                    holds.extend(view.leading(prefix_masks))
            return holds

    def _view(self, engine: str) -> EngineView:
        view = self._views.get(engine)
        if view is None:
            view = self._views[engine] = EngineView(
                engine, max_blocks=self.max_blocks_per_engine, index=self._index
            )
        return view
