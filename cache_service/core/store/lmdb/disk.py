"""LMDB on a full disk: what its write errors mean, and reaching the pages it has freed.

LMDB writes a transaction's pages only when it commits (`writemap` is off), so a full file
system shows there: as ENOSPC (`lmdb.DiskError`) when no byte could be written, and as a
plain `lmdb.Error` "Input/output error" when a write came up short (LMDB turns a short
`pwrite` into EIO). Either way the transaction is aborted and the environment stays usable:
measured on a full tmpfs, the next write that fits in LMDB's free pages commits.

The data file never shrinks, so on a full disk a store lives on the pages it has freed. LMDB
hands the pages freed by commit N out again only from commit N+2 on (it keeps the last two
snapshots whole): after a purge on a full disk, the next write cannot use the room the purge
made, fails, and, not having committed, leaves the next one in the same place, for good.
Measured on a 16 MiB tmpfs: a write after the purge fails; after one tiny commit it succeeds.
So while the disk is full the backend follows each commit with a tiny one (`release_freed`).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import lmdb

from cache_service.core.disk import free_and_margin
from cache_service.core.errors import DiskFull, StorageError, StorageFailure, StoreFull

_RELEASE = b"release"  # the meta key the tiny commit writes

# Errors that say the file system, or the writer's share of it, has no more room.
_NO_ROOM = tuple(os.strerror(code) for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG))
_IO_ERROR = os.strerror(errno.EIO)
# LMDB found its own pages damaged (MDB_CORRUPTED, MDB_PAGE_NOTFOUND): no retry helps.
DAMAGE_ERRORS = (lmdb.CorruptedError, lmdb.PageNotFoundError)


def write_error(exc: lmdb.Error, folder: Path) -> StorageError | None:
    """The service error for an LMDB error raised by a write in `folder`; None for one that
    is a bug rather than a condition of the store (it propagates as it is)."""
    if isinstance(exc, lmdb.MapFullError):
        return StoreFull("the LMDB map is full")
    if isinstance(exc, DAMAGE_ERRORS):
        return damaged_file(folder, exc)
    text = str(exc)
    if isinstance(exc, lmdb.DiskError) or any(reason in text for reason in _NO_ROOM):
        return disk_full(folder, text)
    if _IO_ERROR in text:
        if not disk_has_room(folder):  # the short write of a full disk
            return disk_full(folder, text)
        return StorageFailure(
            f"the disk holding {folder} failed a write ({text}); nothing was stored, reads "
            "go on; check the disk"
        )
    if isinstance(exc, lmdb.PanicError):
        return StorageFailure(
            f"the LMDB environment in {folder} failed ({text}) and takes no more writes; "
            "restart the service (committed data is kept)"
        )
    return None


def damaged_file(folder: Path, exc: lmdb.Error) -> StorageFailure:
    """The 503 of a read or write that found LMDB's own structure damaged in `folder`."""
    return StorageFailure(
        f"the LMDB data file in {folder} is damaged ({exc}); the service cannot repair it: "
        f"stop the service, then remove the folder {folder} (the cache starts empty: it may "
        "forget, it never serves damaged data) or restore it from a copy"
    )


def disk_full(folder: Path, reason: str) -> DiskFull:
    """The 507 of a write the file system holding `folder` had no room for."""
    return DiskFull(
        f"the file system holding {folder} is full ({reason}); nothing was stored, reads go "
        "on, and writes resume once eviction or a purge frees room in the store or space is "
        "freed on the disk"
    )


def release_freed(env: Any, meta_db: Any) -> bool:
    """Commit a tiny transaction, so that the pages the last commit freed can be reused by
    the next write; False if even that found no room (the next write tries again)."""
    try:
        with env.begin(write=True) as txn:
            txn.put(_RELEASE, b"", db=meta_db)
    except lmdb.Error:
        return False
    return True


def disk_has_room(folder: Path) -> bool:
    """Whether the file system holding `folder` has room: twice its margin free (see disk),
    so that a purge running on the reserve it was given keeps reusing what it frees."""
    try:
        free, margin = free_and_margin(folder)
        return free >= 2 * margin
    except OSError:  # the folder is gone or unreadable: a write failed for that, not room
        return True
