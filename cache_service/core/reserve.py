"""A reserve of disk space beside the store, given up so that deletions can run on a full disk.

On a full file system a store lives on the pages it has freed, and a deletion needs fresh
pages before it frees any (LMDB copies each page it changes). A store of many small blocks
can reach a state where even a purge or an eviction batch finds no room: measured on a 64 MiB
tmpfs filled with 1.5 KB blocks, every purge and eviction failed with ENOSPC, and so every
store after them, until space was freed outside the service. The reserve is a file in the
data folder, made while the disk has room; a deletion refused for a full disk releases it
and runs again, and the room the deletion frees stays in the data file for the next writes.
It is made again once the disk has room for it.

The reserve is written as `disk-reserve.<pid>.tmp` and renamed: a process killed in between
leaves that file behind (up to the margin, 32 MiB). A start, and making the reserve, remove
the ones of processes no longer running (the workers of one folder make it concurrently: a running
one's file is its own to finish).
"""

from __future__ import annotations

import os
from pathlib import Path

from cache_service.core.disk import RESERVE_NAME, free_bytes, margin_bytes

__all__ = ["RESERVE_NAME", "DiskReserve", "remove_stale_partials"]


class DiskReserve:
    """The reserve file of one data folder (shared by every process serving it)."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / RESERVE_NAME
        self.size_bytes = margin_bytes(folder)  # the disk's margin (see disk), held once more
        remove_stale_partials(folder)  # at start-up, even when another worker made the reserve

    @property
    def held(self) -> bool:
        """Whether the reserve is in place."""
        return self.path.exists()

    def ensure(self) -> bool:
        """Make the reserve if it is missing and the disk has room for it (beyond the
        nearly-full margin); True if it is in place."""
        if self.held:
            return True
        remove_stale_partials(self.path.parent)
        if free_bytes(self.path.parent) < 2 * self.size_bytes:  # itself, and the margin
            return False
        partial = self.path.with_name(f"{RESERVE_NAME}.{os.getpid()}.tmp")
        try:
            with partial.open("wb") as handle:
                # Allocated blocks, not a sparse file: the space must really be held.
                os.posix_fallocate(handle.fileno(), 0, self.size_bytes)
            partial.replace(self.path)  # whole or absent, even with several processes
        except OSError:
            partial.unlink(missing_ok=True)
            return False
        return True

    def release(self) -> bool:
        """Give the reserve's space back to the file system; True if there was one."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            return False
        return True


def remove_stale_partials(folder: Path) -> int:
    """Remove the partial reserve files in `folder` left by processes no longer running;
    the number removed."""
    removed = 0
    for partial in folder.glob(f"{RESERVE_NAME}.*.tmp"):
        pid = partial.name[len(RESERVE_NAME) + 1 : -len(".tmp")]
        if pid.isdigit() and _running(int(pid)):
            continue  # still writing it (another worker of this folder), or this process
        try:
            partial.unlink(missing_ok=True)
        except OSError:  # not ours to remove (permissions): left as it is
            continue
        removed += 1
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, under another user
        return True
    return True
