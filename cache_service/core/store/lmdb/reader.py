"""A read-only view of a running service's LMDB store, from another process on the same host.

LMDB is built for many reader processes beside one writer: a reader maps the same file,
takes a slot in the lock file's reader table, and sees a consistent snapshot per transaction
while the service writes. `LmdbReader` opens the folder that way (`readonly=True`; the
process needs read access to `data.mdb` and write access to `lock.mdb`, whose reader table it
joins) and answers lookups with payloads through the very `DataPath.match` the service runs:
every record's checksum, namespace, depth, parent and tokens, every payload's length and
checksum, expiry judged by the service's own retention table. It never writes: damage it
meets is noted in its own log only (the service finds the same damage when it reads the
block, and drops it there), and anything it cannot read is a shorter match.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import lmdb

from cache_service.core.blocks import ChainLink, MatchResult, NamespaceId
from cache_service.core.errors import StorageError
from cache_service.core.eviction import make_policy
from cache_service.core.lifetimes import Lifetimes
from cache_service.core.store.lmdb.disk import DAMAGE_ERRORS, damaged_file
from cache_service.core.store.lmdb.store import (
    FORMAT_KEY,
    FORMAT_VERSION,
    TABLES,
    LmdbSpace,
    read_store_id,
)
from cache_service.core.store.lmdb.txn import LmdbTxn
from cache_service.core.store.lmdb.txn_gate import TxnGate
from cache_service.core.store.parts.backend import PayloadSink
from cache_service.core.store.parts.damage import DamageLog
from cache_service.core.store.parts.data_path import DataPath
from cache_service.core.store.parts.txns import Transactions
from cache_service.core.store.protocols import Space


class LmdbReadOnlyBackend:
    """The tables of a store another process writes, opened for reading only."""

    def __init__(self, path: str | os.PathLike[str], *, lifetimes: Lifetimes) -> None:
        self.path = Path(path)
        try:
            found_file = (self.path / "data.mdb").is_file()
        except OSError as exc:  # a folder this process may not enter
            raise StorageError(f"cannot open {self.path} for reading: {exc}") from exc
        if not found_file:
            raise StorageError(f"{self.path} holds no LMDB store (no data.mdb)")
        try:
            self.env = lmdb.open(
                str(self.path), readonly=True, lock=True, max_dbs=16, readahead=False,
                create=False,
            )  # fmt: skip
        except lmdb.Error as exc:
            raise StorageError(f"cannot open {self.path} for reading: {exc}") from exc
        try:
            # py-lmdb maps 10 MiB unless told; 0 takes the size the writer set, so that a
            # resize (MapResizedError, below) is needed only when the writer grows the map.
            self.env.set_mapsize(0)
            self.main_db = self.env.open_db(None)
            self.dbs = {name: self.env.open_db(name.encode(), create=False) for name in TABLES}
            with self.env.begin() as txn:
                found = txn.get(FORMAT_KEY, db=self.dbs["meta"])
        except lmdb.Error as exc:
            self.env.close()
            raise StorageError(f"{self.path} is not a store this build reads: {exc}") from exc
        if found is None or bytes(found) != FORMAT_VERSION:
            self.env.close()
            raise StorageError(
                f"{self.path} holds store format {found!r}; this build reads {FORMAT_VERSION!r}"
            )
        self.store_id = read_store_id(self.env, self.dbs["meta"])
        self.damage = DamageLog()
        self.lifetimes = lifetimes
        self.space: Space = LmdbSpace(self.path, int(self.env.stat()["psize"]), len(self.dbs))
        # A resize or close waits for the transactions other threads have open.
        self._gate = TxnGate()
        self._closed = False

    @contextmanager
    def read(self, *, views: bool = False) -> Iterator[LmdbTxn]:
        """A read transaction; after the writer grew the map, the new size is adopted first."""
        for _attempt in range(2):
            with self._gate.shared():
                if self._closed:
                    raise StorageError(f"{self.path} was closed")
                try:
                    txn = self._begin(views)
                except lmdb.MapResizedError:
                    pass
                else:
                    try:
                        with txn:
                            yield LmdbTxn(self, txn)
                    except DAMAGE_ERRORS as exc:
                        raise damaged_file(self.path, exc) from exc
                    return
            with self._gate.exclusive():
                if not self._closed:
                    self.env.set_mapsize(0)  # 0: take the size the writer set
        raise StorageError(f"{self.path}: the map grew again while it was being adopted")

    def _begin(self, views: bool) -> lmdb.Transaction:
        return self.env.begin(buffers=True) if views else self.env.begin()

    def write(self) -> NoReturn:
        """Never: this process only reads."""
        raise StorageError(f"{self.path} is open for reading only")

    def close(self) -> None:
        """Close the environment (and give back its reader slot) once no read is open."""
        with self._gate.exclusive():
            self._closed = True
            self.env.close()


class LmdbReader(DataPath):
    """Lookups with payloads over a store that another process (the service) writes."""

    def __init__(self, path: str | os.PathLike[str], *, lifetimes: Lifetimes) -> None:
        self.backend = LmdbReadOnlyBackend(path, lifetimes=lifetimes)
        self.txns = Transactions(self.backend, make_policy())  # the policy learns from writes
        self.damage = self.backend.damage
        self.path = self.backend.path
        self.store_id = self.backend.store_id

    def read_prefix(
        self,
        namespace: NamespaceId,
        links: Sequence[ChainLink],
        *,
        now: float,
        sink: PayloadSink,
    ) -> MatchResult:
        """The leading links stored, alive and verified as the service's own lookup with
        payloads verifies them, each payload handed to `sink` as bytes of its own."""
        return self.match(namespace, links, now=now, with_payloads=True, sink=sink, copied=True)

    def close(self) -> None:
        """Close the environment."""
        self.backend.close()
