"""Recently verified matches, so a repeated prompt is neither hashed nor verified again.

A lookup proves its prefix block by block. For a prompt seen recently, one read suffices: if
the last block it matched is still the very copy that was verified (its incarnation, a number
drawn once per write that no other write of any block gets) and alive, no block of the prefix
can have been removed (only leaves are deleted), replaced (a stored block's content never
changes while it has children) or expired (a parent never expires before its child; while a
write is ahead of the clock a parent may be from the future, and the store reads every block).
The memo is keyed by the exact prompt bytes (compared in full, never trusted to a hash) and
bounded in bytes; it is per process and only an accelerator: a stale entry costs one read.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import xxhash

from cache_service.core.blocks import Chain, StoreKey

DEFAULT_MAX_BYTES = 64 * 2**20
DEFAULT_MAX_ENTRIES = 4096


@dataclass(frozen=True, slots=True)
class RecentMatch:
    """A prompt's chain and how much of it was verified, as of `incarnation`."""

    chain: Chain
    matched: int
    incarnation: bytes


class RecentMatches:
    """A bounded LRU memo: (namespace scope, block size, prompt bytes) -> RecentMatch."""

    def __init__(
        self, *, max_bytes: int = DEFAULT_MAX_BYTES, max_entries: int = DEFAULT_MAX_ENTRIES
    ) -> None:
        self._entries: OrderedDict[tuple[StoreKey, int, int], RecentMatch] = OrderedDict()
        self._bytes = 0
        self._max_bytes = max_bytes
        self._max_entries = max_entries
        self._lock = threading.Lock()

    @staticmethod
    def _key(scope: StoreKey, block_size: int, token_bytes: bytes) -> tuple[StoreKey, int, int]:
        return scope, block_size, xxhash.xxh3_64_intdigest(token_bytes)

    def get(self, scope: StoreKey, block_size: int, token_bytes: bytes) -> RecentMatch | None:
        """The memo of exactly this prompt, if any."""
        key = self._key(scope, block_size, token_bytes)
        with self._lock:
            found = self._entries.get(key)
            if found is None or found.chain.token_bytes != token_bytes:
                return None
            self._entries.move_to_end(key)
            return found

    def put(self, scope: StoreKey, block_size: int, match: RecentMatch) -> None:
        """Remember a verified match (of at least one block)."""
        size = len(match.chain.token_bytes) + 16 * len(match.chain.keys)
        if size > self._max_bytes:
            return
        key = self._key(scope, block_size, match.chain.token_bytes)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= len(old.chain.token_bytes) + 16 * len(old.chain.keys)
            self._entries[key] = match
            self._bytes += size
            while self._bytes > self._max_bytes or len(self._entries) > self._max_entries:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= len(dropped.chain.token_bytes) + 16 * len(dropped.chain.keys)

    def __len__(self) -> int:
        return len(self._entries)
