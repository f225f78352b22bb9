"""The file system under a store: how much room it can still give, whether a capacity fits
on it, and a rate-limited warning when it does not.

A store's `--capacity` counts the pages it uses; the disk has to hold them. When the file
system holds less than the capacity asks, the store evicts at what the disk can back, less a
margin kept free for deletions (`DiskRoom.limit_bytes`): the cache still works, at the size
the disk allows, and says so. If the disk fills all the same (another program wrote to it),
a write evicts to make room in the data file and answers 507 disk-full only when nothing
can be evicted.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from cache_service.core.units import show_size

# The margin: room kept free on the disk for deletions (a deletion needs fresh pages before it
# frees any; a purge batch of 1024 small pinned blocks took 11.5 MB), 32 MiB or an eighth of
# a small disk. Below it the file system counts as full,
# and an I/O error on a commit is the short write of a full disk (LMDB reports one as EIO).
MARGIN_MAX_BYTES = 32 * 2**20
# The reserve file (see reserve) in the data folder: space held for deletions, so it is part
# of the margin, not more room to keep free beside it.
RESERVE_NAME = "disk-reserve"
MARGIN_SHARE = 1 / 8
WARN_EVERY_SECONDS = 300.0

log = logging.getLogger("cache_service")


@dataclass(frozen=True, slots=True)
class DiskRoom:
    """The room a store has on its file system, measured now."""

    folder: Path
    free_bytes: int  # what the file system can still give (unprivileged free blocks)
    file_bytes: int  # what the store's data file takes already
    capacity_bytes: int | None
    margin_bytes: int  # room kept for deletions (see margin_bytes())
    reserve_bytes: int = 0  # of it, what the reserve file holds already (see reserve)

    @property
    def backed_bytes(self) -> int:
        """The most the store can hold on this disk: its file plus the free room."""
        return self.file_bytes + self.free_bytes

    @property
    def shortfall_bytes(self) -> int:
        """How much of the capacity the disk cannot back (0 when it fits)."""
        if self.capacity_bytes is None:
            return 0
        return max(self.capacity_bytes - self.backed_bytes, 0)

    @property
    def full(self) -> bool:
        """Whether the file system is (all but) full: less than the margin is free."""
        return self.free_bytes < self.margin_bytes

    @property
    def kept_free_bytes(self) -> int:
        """The part of the margin free room must give: the reserve file holds the rest
        (counting it again reserved the margin twice: a small disk got a limit of 0)."""
        return max(self.margin_bytes - self.reserve_bytes, 0)

    @property
    def limit_bytes(self) -> int:
        """The most the store should use on this disk: what it can back, less the margin
        kept for deletions (evicting there keeps a purge possible on a disk this size)."""
        return max(self.backed_bytes - self.kept_free_bytes, 0)

    def describe(self) -> str:
        """One line for the log: the room, and what the capacity asks beyond it."""
        line = (
            f"the file system holding {self.folder} has {show_size(self.free_bytes)} free "
            f"(the data file takes {show_size(self.file_bytes)})"
        )
        if self.shortfall_bytes:
            assert self.capacity_bytes is not None
            line += (
                f": --capacity {show_size(self.capacity_bytes)} is "
                f"{show_size(self.shortfall_bytes)} more than this disk can hold: the store "
                f"evicts at {show_size(self.limit_bytes)} instead (the disk less "
                f"{show_size(self.kept_free_bytes)} kept for deletions), and answers 507 "
                "disk-full when nothing can be evicted; lower --capacity or free space on "
                "the disk"
            )
        return line


def free_bytes(folder: Path) -> int:
    """The bytes an unprivileged writer may still put on the file system holding `folder`."""
    stat = os.statvfs(folder)
    return stat.f_bavail * stat.f_frsize


def margin_bytes(folder: Path) -> int:
    """The room kept free for deletions on the file system holding `folder`."""
    return free_and_margin(folder)[1]


def free_and_margin(folder: Path) -> tuple[int, int]:
    """`free_bytes` and `margin_bytes` of one statvfs (the write path asks for both)."""
    stat = os.statvfs(folder)
    margin = min(MARGIN_MAX_BYTES, int(stat.f_blocks * stat.f_frsize * MARGIN_SHARE))
    return stat.f_bavail * stat.f_frsize, margin


def measure_room(folder: Path, file_bytes: int, capacity_bytes: int | None) -> DiskRoom:
    """The room of a store whose data file (in `folder`) takes `file_bytes` now."""
    free, margin = free_and_margin(folder)
    return DiskRoom(folder, free, file_bytes, capacity_bytes, margin, reserve_held_bytes(folder))


def reserve_held_bytes(folder: Path) -> int:
    """The bytes the reserve file in `folder` holds (0 when it is not in place)."""
    try:
        return min((folder / RESERVE_NAME).stat().st_size, margin_bytes(folder))
    except FileNotFoundError:
        return 0


class DiskWarning:
    """Logs a disk that cannot back the capacity, or is full: at once, then at most once
    every `every_seconds` while it lasts, and once when it is over. The times are kept per
    folder for the whole process: the start-up check and the running cache share them."""

    _last_warned: ClassVar[dict[Path, float]] = {}  # per process, on purpose (see above)

    def __init__(
        self,
        *,
        every_seconds: float = WARN_EVERY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.every_seconds = every_seconds
        self.clock = clock

    def check(self, room: DiskRoom) -> bool:
        """Warn about `room` if it is short (rate-limited); True if it was logged now."""
        last = self._last_warned.get(room.folder)
        if not (room.shortfall_bytes or room.full):
            if last is not None:
                log.info("disk room is back: %s", room.describe())
                del self._last_warned[room.folder]
            return False
        now = self.clock()
        if last is not None and now - last < self.every_seconds:
            return False
        self._last_warned[room.folder] = now
        log.warning("%s", room.describe())
        return True
