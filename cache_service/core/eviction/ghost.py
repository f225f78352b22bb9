"""A bounded list of recently evicted keys whose changes in a write transaction can be undone."""

from __future__ import annotations

from collections import OrderedDict

from cache_service.core.blocks import StoreKey

GHOST_FLOOR = 1024  # entries kept whatever the store holds

# One undo step: put `value` back under `key` (None: remove the key); `front`: at the oldest end.
_Undo = tuple[StoreKey, bool | None, bool]


class Ghost:
    """Evicted keys, oldest first, each with whether the block had been hit; at most `limit`.

    A store's write transaction may abort after the policy saw its evictions and stores (a
    full LMDB map aborts and retries): between `mark` and `settle` every change is logged, and
    `undo` puts the list back as it was (a key taken from the middle returns at the newest end:
    the order only decides which keys are forgotten first)."""

    def __init__(self) -> None:
        self._keys: OrderedDict[StoreKey, bool] = OrderedDict()
        self.limit = GHOST_FLOOR
        self._undo: list[_Undo] | None = None

    def __len__(self) -> int:
        return len(self._keys)

    def take(self, key: StoreKey) -> bool | None:
        """Remove `key`; whether its block had been hit, or None if the ghost lacks it."""
        was_hit = self._keys.pop(key, None)
        if was_hit is not None and self._undo is not None:
            self._undo.append((key, was_hit, False))
        return was_hit

    def add(self, key: StoreKey, was_hit: bool) -> None:
        """Remember `key` as the newest entry, forgetting the oldest beyond the limit."""
        keys = self._keys
        if self._undo is not None:
            self._undo.append((key, keys.get(key), False))
        keys[key] = was_hit
        keys.move_to_end(key)
        while len(keys) > self.limit:
            oldest, value = keys.popitem(last=False)
            if self._undo is not None:
                self._undo.append((oldest, value, True))

    def mark(self) -> None:
        """Start logging changes (a write transaction begins)."""
        self._undo = []

    def settle(self) -> None:
        """Keep the changes since `mark` (the transaction committed)."""
        self._undo = None

    def undo(self) -> None:
        """Put back every change since `mark` (the transaction aborted)."""
        for key, value, front in reversed(self._undo or ()):
            if value is None:
                self._keys.pop(key, None)
            else:
                self._keys[key] = value
                self._keys.move_to_end(key, last=not front)
        self._undo = None
