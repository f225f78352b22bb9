"""The guards around same-host reads: the offer is told over loopback only, a store keeps the
random id a reader checks, a reader closing waits for the reads other threads have open, and
the service frees the reader slots of processes that died reading."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import lmdb
import pytest
from starlette.requests import Request

from cache_service.core.errors import StorageError
from cache_service.core.retention import DEFAULT_LIFETIMES
from cache_service.core.store.lmdb.reader import LmdbReader
from cache_service.core.store.lmdb.store import FORMAT_KEY, STORE_ID_KEY, LmdbStore
from cache_service.core.store.lmdb.txn_gate import TxnGate
from cache_service.service.api.local_reads import _on_loopback

MAP = 1 << 26


def caller(client: tuple[str, int] | None) -> Request:
    """A request as uvicorn hands it over, from `client` (None: a Unix socket)."""
    return Request({"type": "http", "method": "GET", "path": "/", "headers": [], "client": client})


@pytest.mark.parametrize(
    ("client", "told"),
    [
        (("127.0.0.1", 5000), True),
        (("127.8.9.1", 5000), True),
        (("::1", 5000), True),
        (None, True),
        (("10.1.2.3", 5000), False),
        (("::ffff:10.1.2.3", 5000), False),
        (("somehost", 5000), False),
    ],
)
def test_the_offer_is_told_over_loopback_only(client: tuple[str, int] | None, told: bool) -> None:
    assert _on_loopback(caller(client)) is told


def test_a_store_keeps_the_id_it_was_made_with(tmp_path: Path) -> None:
    first = LmdbStore(tmp_path / "a", map_size_bytes=MAP)
    made = first.disk.store_id
    first.close()
    again = LmdbStore(tmp_path / "a", map_size_bytes=MAP)
    other = LmdbStore(tmp_path / "b", map_size_bytes=MAP)
    assert len(made) == 32 and again.disk.store_id == made != other.disk.store_id
    again.close()
    other.close()
    reader = LmdbReader(tmp_path / "a", lifetimes=DEFAULT_LIFETIMES)  # as another process would
    assert reader.store_id == made
    reader.close()


def test_a_reader_closes_only_after_the_reads_open_in_other_threads(tmp_path: Path) -> None:
    LmdbStore(tmp_path, map_size_bytes=MAP).close()
    reader = LmdbReader(tmp_path, lifetimes=DEFAULT_LIFETIMES)
    reading, release = threading.Event(), threading.Event()
    seen: list[object] = []

    def read() -> None:
        with reader.backend.read() as txn:
            reading.set()
            release.wait(5)
            seen.append(txn)

    thread = threading.Thread(target=read)
    thread.start()
    assert reading.wait(5)
    closer = threading.Thread(target=reader.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # waits for the open read
    release.set()
    thread.join(5)
    closer.join(5)
    assert not closer.is_alive() and len(seen) == 1
    with pytest.raises(StorageError, match="closed"), reader.backend.read():
        pass


def test_the_gate_lets_reads_overlap_and_holds_them_off_during_a_change() -> None:
    gate, order = TxnGate(), []
    with gate.shared(), gate.shared():  # two reads at once
        order.append("two reads")
    changing = threading.Event()

    def change() -> None:
        with gate.exclusive():
            changing.set()
            time.sleep(0.2)
            order.append("changed")

    thread = threading.Thread(target=change)
    thread.start()
    assert changing.wait(5)
    with gate.shared():
        order.append("read after")
    thread.join(5)
    assert order == ["two reads", "changed", "read after"]


def _read_and_wait(path: str, ready: multiprocessing.synchronize.Event) -> None:
    env = lmdb.open(path, readonly=True, max_dbs=16)
    txn = env.begin()  # a reader slot, held until the process dies
    ready.set()
    time.sleep(60)
    txn.abort()


def test_the_slot_of_a_reader_killed_mid_read_is_freed(tmp_path: Path) -> None:
    store = LmdbStore(tmp_path, map_size_bytes=MAP)
    ready = multiprocessing.get_context("spawn").Event()
    child = multiprocessing.get_context("spawn").Process(
        target=_read_and_wait, args=(str(tmp_path), ready)
    )
    child.start()
    try:
        assert ready.wait(30)
        assert child.pid is not None
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        assert store.disk is not None and store.disk.clear_stale_readers() == 1
        assert store.disk.clear_stale_readers() == 0
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        store.close()


@pytest.mark.parametrize("with_id", [True, False])
def test_a_store_of_a_format_this_build_does_not_read_is_refused_with_or_without_an_id(
    tmp_path: Path, with_id: bool
) -> None:
    LmdbStore(tmp_path, map_size_bytes=MAP).close()
    env = lmdb.open(str(tmp_path), max_dbs=16)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.put(FORMAT_KEY, b"99", db=meta)
        if not with_id:  # a store made before store ids
            txn.delete(STORE_ID_KEY, db=meta)
    env.close()
    with pytest.raises(StorageError, match="holds store format b'99'"):
        LmdbStore(tmp_path, map_size_bytes=MAP)
    env = lmdb.open(str(tmp_path), max_dbs=16)
    meta = env.open_db(b"meta")
    with env.begin() as txn:  # the refused opener wrote nothing
        assert (txn.get(STORE_ID_KEY, db=meta) is not None) is with_id
    env.close()
