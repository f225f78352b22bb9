"""The LMDB store: block records, payloads, namespaces and two ordered indexes in one environment.

Durability: every write is one short transaction; a caller is answered only after it commits.
`writemap` stays off, so a full disk is an error on write, never a SIGBUS. Sync mode "full"
flushes every commit (nothing acknowledged is lost, nothing is corrupted); "nometasync" may
undo the last transaction on a system crash; "nosync" leaves flushing to the OS, and a system
crash may then lose recent writes or, where the file system reorders writes, corrupt the file.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb

from cache_service.core.errors import DiskFull, StorageError, StoreFull
from cache_service.core.eviction import EvictionPolicy
from cache_service.core.lifetimes import UNBOUNDED, Lifetimes
from cache_service.core.store.lmdb.disk import (
    DAMAGE_ERRORS,
    damaged_file,
    disk_has_room,
    release_freed,
    write_error,
)
from cache_service.core.store.lmdb.migrations import migrate
from cache_service.core.store.lmdb.txn import LmdbTxn
from cache_service.core.store.parts.backend import AUX_TABLES, INDEXES
from cache_service.core.store.parts.codec import (
    record_size,
)
from cache_service.core.store.parts.composed import ComposedStore
from cache_service.core.store.parts.damage import DamageLog
from cache_service.core.store.parts.removals import DEFAULT_REMOVAL_LOG_ENTRIES
from cache_service.core.store.protocols import Capabilities, IdentityCheck, OnDisk

FORMAT_VERSION = b"4"  # format 4: block records carry a checksum (format 3 is migrated)
MIGRATES_FROM = frozenset({b"3"})  # formats migrated in place when opened (migrations.py)
SYNC_MODES = {
    "full": {"sync": True, "metasync": True},
    "nometasync": {"sync": True, "metasync": False},
    "nosync": {"sync": False, "metasync": False},
}
FORMAT_KEY = b"format"  # in the meta table: the store format's version (FORMAT_VERSION)
# The environment's named tables; a reader in another process opens the same ones.
TABLES = ("blocks", "payloads", "namespaces", *INDEXES, "meta", *AUX_TABLES)
_IDENTITY = b"identity"  # the settings the data was made with (see cache_service.core.identity)
# In the meta table: this store's own random id, written once when it is made, so that a
# same-host reader can tell the service's files from another store's at the same path.
STORE_ID_KEY = b"store_id"


def read_store_id(env: Any, meta: Any) -> str:
    """The store's own id ("" for a store no writer of this build has opened yet)."""
    with env.begin() as txn:
        found = txn.get(STORE_ID_KEY, db=meta)
    return bytes(found).decode("ascii", "replace") if found is not None else ""


class LmdbSpace:
    """The LMDB backend's capacity report: the pages blocks take, and the data file."""

    def __init__(self, path: Path, psize: int, tables: int) -> None:
        self._path = path
        self._psize = psize
        self._tables = tables

    def estimate_bytes(self, payload_size: int, token_bytes: int) -> int:
        """Pages one block takes: overflow pages for a large payload, leaf space for the rest."""
        psize = self._psize
        if payload_size > psize // 2 - 64:
            payload = math.ceil((payload_size + 16) / psize) * psize
        else:
            payload = 2 * (payload_size + 32)  # B-tree leaves run about half full
        record = 2 * (record_size(token_bytes) + 32)
        indexes = 2 * 2 * (8 + 16 + 16)
        return payload + record + indexes

    def reserved_bytes(self) -> int:
        """Two meta pages, and a root page for the main table and each named one."""
        return (2 + 1 + self._tables) * self._psize

    def file_bytes(self) -> int:
        """The size of the data file on disk (live pages plus LMDB's free list)."""
        return (self._path / "data.mdb").stat().st_size


class LmdbBackend:
    """Block records, payloads, namespaces, indexes and small tables in one LMDB environment."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_size_bytes: int,
        sync_mode: str = "full",
        max_readers: int = 1024,
        identity: IdentityCheck | None = None,
        lifetimes: Lifetimes = UNBOUNDED,
    ) -> None:
        if sync_mode not in SYNC_MODES:
            raise ValueError(
                f"unknown LMDB sync mode {sync_mode!r} (known: {', '.join(SYNC_MODES)})"
            )
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(
            str(self.path),
            map_size=map_size_bytes,
            max_dbs=16,
            max_readers=max_readers,
            writemap=False,  # with writemap a full disk kills the process with SIGBUS
            readahead=False,  # random block reads; readahead only pollutes the page cache
            meminit=False,
            **SYNC_MODES[sync_mode],
        )
        self.env.reader_check()  # clear reader slots left by killed processes
        self.main_db = self.env.open_db(None)
        self.dbs = {name: self.env.open_db(name.encode()) for name in TABLES}
        self.damage = DamageLog()
        self.lifetimes = lifetimes  # each class's TTL bounds a block's expiry (core.lifetimes)
        # Set when the opening checks passed but a full disk kept their record from being
        # written (a steering setting changed): the store opens read-mostly all the same.
        self.unrecorded: DiskFull | None = None
        # While the disk is full, each commit is followed by a tiny one (see lmdb_disk).
        self.disk_full = not disk_has_room(self.path)
        try:
            if self._check_record(identity):
                migrate(self.env, self.dbs["blocks"], where=str(self.path))
                with self.env.begin(write=True) as txn:
                    txn.put(FORMAT_KEY, FORMAT_VERSION, db=self.dbs["meta"])
        except lmdb.Error as exc:
            self.unrecorded = self._open_on_full_disk(exc)
        except BaseException:
            self.env.close()  # a refused opener leaves no environment open behind it
            raise
        if self.disk_full:  # the last run's last commit (a purge?) freed pages: reach them
            release_freed(self.env, self.dbs["meta"])
        self.space = LmdbSpace(self.path, int(self.env.stat()["psize"]), len(self.dbs))
        self.store_id = read_store_id(self.env, self.dbs["meta"])

    def _check_record(self, identity: IdentityCheck | None) -> bool:
        """Check the format and the identity record, writing what a new store lacks, in one
        write transaction: LMDB runs one writer at a time across processes, so of workers
        opening a new folder together one records and the others check against it. True
        when the store holds an older format to migrate (after the identity is settled, so
        a refused opener rewrites nothing)."""
        meta = self.dbs["meta"]
        with self.env.begin(write=True) as txn:
            found = txn.get(FORMAT_KEY, db=meta)
            stored_format = bytes(found) if found is not None else None
            if stored_format is None:
                txn.put(FORMAT_KEY, FORMAT_VERSION, db=meta)
            elif stored_format != FORMAT_VERSION and stored_format not in MIGRATES_FROM:
                raise StorageError(
                    f"{self.path} holds store format {stored_format!r}; this build reads "
                    f"{FORMAT_VERSION!r} (and migrates {b', '.join(sorted(MIGRATES_FROM))!r})"
                )
            if txn.get(STORE_ID_KEY, db=meta) is None:  # new, or made before store ids
                txn.put(STORE_ID_KEY, os.urandom(16).hex().encode(), db=meta)
            if identity is not None:
                raw = txn.get(_IDENTITY, db=meta)
                stored = bytes(raw) if raw is not None else None
                record = identity.settle(stored, where=str(self.path))
                if record != stored:
                    txn.put(_IDENTITY, record, db=meta)
        return stored_format in MIGRATES_FROM

    @contextmanager
    def read(self, *, views: bool = False) -> Iterator[LmdbTxn]:
        """A read transaction; with `views`, payloads are read as buffers (no copy)."""
        try:
            with self.env.begin(buffers=True) if views else self.env.begin() as txn:
                yield LmdbTxn(self, txn)
        except DAMAGE_ERRORS as exc:  # LMDB's own pages are damaged: a 503 that says so
            raise damaged_file(self.path, exc) from exc

    @contextmanager
    def write(self) -> Iterator[LmdbTxn]:
        """A write transaction; its counters are written once, just before it commits."""
        try:
            with self.env.begin(write=True) as txn:
                wrapped = LmdbTxn(self, txn)
                yield wrapped
                wrapped.flush()
        except lmdb.Error as exc:  # a full map or disk (ENOSPC, a short write's EIO), a bad disk
            error = write_error(exc, self.path)
            if error is None:
                raise
            if isinstance(error, StoreFull):  # a full disk or map: no fresh pages
                self.disk_full = isinstance(error, DiskFull)
                release_freed(self.env, self.dbs["meta"])  # for the next try (lmdb_disk)
            raise error from exc
        if self.disk_full or not disk_has_room(self.path):  # a statvfs: microseconds
            release_freed(self.env, self.dbs["meta"])  # what this commit freed, for the next
            self.disk_full = not disk_has_room(self.path)

    def _open_on_full_disk(self, exc: lmdb.Error) -> DiskFull:
        """The opening write failed: go on if only the disk was full and the store's format
        is already this build's (its checks passed before the commit); else close, raise."""
        error = write_error(exc, self.path)
        if isinstance(error, DiskFull):
            with self.env.begin() as txn:
                found = txn.get(FORMAT_KEY, db=self.dbs["meta"])
            if found is not None and bytes(found) == FORMAT_VERSION:
                return error
        self.env.close()  # a refused opener leaves no environment open behind it
        if error is None:
            raise exc
        raise error from exc

    def close(self) -> None:
        """Close the environment."""
        self.env.close()


class LmdbStore(ComposedStore[LmdbBackend]):
    """A BlockStore in an LMDB environment on disk; safe to share between processes."""

    capabilities = Capabilities(
        "LMDB",
        lacks={"remote": "a file on this machine: no server between the cache and it"},
    )

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_size_bytes: int,
        sync_mode: str = "full",
        max_readers: int = 1024,
        policy: EvictionPolicy | None = None,
        identity: IdentityCheck | None = None,
        removal_log_entries: int = DEFAULT_REMOVAL_LOG_ENTRIES,
        lifetimes: Lifetimes = UNBOUNDED,
    ) -> None:
        backend = LmdbBackend(
            path,
            map_size_bytes=map_size_bytes,
            sync_mode=sync_mode,
            max_readers=max_readers,
            identity=identity,
            lifetimes=lifetimes,
        )
        super().__init__(backend, policy=policy, removal_log_entries=removal_log_entries)
        self.space: LmdbSpace = backend.space  # with the data file's size
        self.path = backend.path
        self.env = backend.env
        self.disk = OnDisk(
            backend.path,
            backend.space.file_bytes,
            backend.unrecorded,
            backend.store_id,
            backend.env.reader_check,
        )
