"""Many read transactions at once, or one change to the environment with none open.

LMDB allows a map resize (`set_mapsize`) or a close only while the process has no
transaction open; a reader used from several threads meets both while others read.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class TxnGate:
    """Shared entry for transactions, exclusive entry for what needs none open."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._open = 0
        self._exclusive = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        """Held while one transaction is open; waits while a change is under way."""
        with self._changed:
            self._changed.wait_for(lambda: not self._exclusive)
            self._open += 1
        try:
            yield
        finally:
            with self._changed:
                self._open -= 1
                self._changed.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Held while the environment changes: no transaction is open meanwhile."""
        with self._changed:
            self._changed.wait_for(lambda: not self._exclusive and self._open == 0)
            self._exclusive = True
        try:
            yield
        finally:
            with self._changed:
                self._exclusive = False
                self._changed.notify_all()
