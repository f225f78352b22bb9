"""Deletions in short write transactions whose size adapts to a full store.

On a full disk or map a deletion needs fresh pages before it frees any (LMDB copies each page
it changes), so a large batch can fail where a small one succeeds; and what a small batch
frees lets the next one be larger. Eviction and purge both delete this way.
"""

from __future__ import annotations

from collections.abc import Callable

from cache_service.core.errors import StoreFull

SHRINK_FACTOR = 8  # a batch refused as full is tried this many times smaller
GROW_FACTOR = 2  # a batch that succeeded lets the next be this many times larger


def in_batches(run: Callable[[int], int], *, largest: int) -> None:
    """Call `run(size)` (one transaction deleting up to `size` items, returning how many it
    deleted) until a batch falls short. A batch refused with StoreFull (its transaction
    aborted, nothing done) is tried `SHRINK_FACTOR` times smaller, down to one item, and
    StoreFull is raised only when even one item cannot go; after each batch that succeeds
    the size grows back towards `largest`."""
    size = largest
    while True:
        try:
            done = run(size)
        except StoreFull:  # a full disk or a full map: no fresh pages for the batch
            if size == 1:
                raise
            size = max(size // SHRINK_FACTOR, 1)
            continue
        if done < size:
            return
        size = min(size * GROW_FACTOR, largest)
