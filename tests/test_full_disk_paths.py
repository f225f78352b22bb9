"""The error paths of a full disk, without one: LMDB's errors mapped to service errors, the
store's answer to a failed commit, eviction and a purge on a full disk, the disk warning and
the background jobs that meet a full disk. tests/reliability/test_full_disk.py fills a real
one."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb
import pytest

from cache_service.core.blocks import Evicted, Namespace, StoreUsage
from cache_service.core.cache import PrefixCache
from cache_service.core.capacity import EVICT_BATCH_BLOCKS, Capacity, CapacityLimits
from cache_service.core.config import CacheConfig
from cache_service.core.disk import RESERVE_NAME, DiskRoom, DiskWarning, measure_room
from cache_service.core.errors import DiskFull, StorageFailure, StoreFull
from cache_service.core.reserve import DiskReserve, remove_stale_partials
from cache_service.core.retention import DEFAULT_LIFETIMES
from cache_service.core.store.lmdb import disk as lmdb_disk
from cache_service.core.store.lmdb.disk import write_error
from cache_service.core.store.lmdb.store import LmdbStore
from cache_service.core.store.memory import MemoryStore
from cache_service.service.api.background import repeat

NS = Namespace(model="m")
BLOCK = 4
MAP_BYTES = 1 << 30


def room(free_bytes: int, *, file_bytes: int = 0, capacity_bytes: int | None = None) -> DiskRoom:
    """A measured disk room (a 1 MiB margin)."""
    return DiskRoom(Path("/data"), free_bytes, file_bytes, capacity_bytes, 2**20)


# -- LMDB errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "error",
    [
        lmdb.DiskError("mdb_txn_commit", "No space left on device"),
        lmdb.Error("mdb_txn_commit: Disk quota exceeded"),
    ],
)
def test_no_room_errors_are_disk_full(error: lmdb.Error, tmp_path: Path) -> None:
    found = write_error(error, tmp_path)
    assert isinstance(found, DiskFull)
    assert found.status == 507 and found.problem == "disk-full"
    assert str(tmp_path) in found.detail


def test_an_io_error_on_a_full_disk_is_the_short_write_of_a_full_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lmdb_disk, "free_and_margin", lambda folder: (0, 2**20))
    found = write_error(lmdb.Error("mdb_txn_commit: Input/output error"), tmp_path)
    assert isinstance(found, DiskFull)


def test_an_io_error_with_room_left_is_a_storage_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lmdb_disk, "free_and_margin", lambda folder: (1 << 40, 2**20))
    found = write_error(lmdb.Error("mdb_txn_commit: Input/output error"), tmp_path)
    assert isinstance(found, StorageFailure) and found.status == 503


def test_map_full_panic_and_bugs(tmp_path: Path) -> None:
    assert type(write_error(lmdb.MapFullError("mdb_put", "full"), tmp_path)) is StoreFull
    panic = write_error(lmdb.PanicError("mdb_txn_begin", "panic"), tmp_path)
    assert isinstance(panic, StorageFailure) and "restart" in panic.detail
    assert write_error(lmdb.BadValsizeError("mdb_put", "bad size"), tmp_path) is None


# -- the LMDB store on a failed commit -------------------------------------------------------


class _FailingCommits:
    """An LMDB environment whose write transactions fail at commit while `failing` is set."""

    def __init__(self, env: Any) -> None:
        self._env = env
        self.failing = True
        self.commits = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    @contextmanager
    def _failing_write(self) -> Iterator[Any]:
        txn = self._env.begin(write=True)
        try:
            yield txn
        finally:
            txn.abort()  # as a commit that failed leaves it (py-lmdb 1.4 refuses a second abort)
        raise lmdb.DiskError("mdb_txn_commit", "No space left on device")

    def begin(self, *, write: bool = False, **kwargs: Any) -> Any:
        if write and self.failing:
            return self._failing_write()
        if write:
            self.commits += 1
        return self._env.begin(write=write, **kwargs)


def test_a_commit_failing_for_room_is_disk_full_and_nothing_is_stored(tmp_path: Path) -> None:
    store = LmdbStore(tmp_path / "lmdb", map_size_bytes=MAP_BYTES, lifetimes=DEFAULT_LIFETIMES)
    cache = PrefixCache(store, config=CacheConfig(default_block_size=BLOCK))
    cache.insert(NS, list(range(8)), [b"a", b"b"])
    failing = _FailingCommits(store.backend.env)
    store.backend.env = failing
    with pytest.raises(DiskFull) as raised:
        cache.insert(NS, list(range(100, 108)), [b"c", b"d"])
    assert raised.value.status == 507
    assert store.backend.disk_full
    failing.failing = False
    assert cache.match_prefix(NS, list(range(8))).matched_blocks == 2  # reads go on
    assert cache.match_prefix(NS, list(range(100, 108))).matched_blocks == 0
    cache.insert(NS, list(range(100, 108)), [b"c", b"d"])  # room again: the write succeeds
    # While the disk was full, the commit was followed by a tiny one (lmdb_disk).
    assert failing.commits >= 2
    store.close()


def test_a_store_opens_read_mostly_when_only_its_record_could_not_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    LmdbStore(tmp_path / "lmdb", map_size_bytes=MAP_BYTES).close()

    def full(self: Any, identity: Any) -> bool:
        raise lmdb.DiskError("mdb_txn_commit", "No space left on device")

    monkeypatch.setattr("cache_service.core.store.lmdb.store.LmdbBackend._check_record", full)
    store = LmdbStore(tmp_path / "lmdb", map_size_bytes=MAP_BYTES)
    assert isinstance(store.backend.unrecorded, DiskFull)
    store.close()


def test_a_new_store_on_a_full_disk_is_refused_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(self: Any, identity: Any) -> bool:
        raise lmdb.DiskError("mdb_txn_commit", "No space left on device")

    monkeypatch.setattr("cache_service.core.store.lmdb.store.LmdbBackend._check_record", full)
    with pytest.raises(DiskFull):
        LmdbStore(tmp_path / "lmdb", map_size_bytes=MAP_BYTES)


# -- eviction and purge on a full disk --------------------------------------------------------


class _TightStore:
    """A store double: `evict` fails for a full disk above `fits` blocks a batch."""

    capabilities = MemoryStore.capabilities  # one that evicts
    disk = None
    space: Any = None

    def __init__(self, fits: int, blocks: int) -> None:
        self.fits = fits
        self.blocks = blocks
        self.sizes: list[int] = []

    def evict(self, *, now: float, max_blocks: int, **_: Any) -> list[Evicted]:
        self.sizes.append(max_blocks)
        if max_blocks > self.fits:
            raise DiskFull("no room")
        count = min(max_blocks, self.blocks)
        self.blocks -= count
        return [Evicted(b"k" * 16, "capacity", "chat", 0.0, 1)] * count  # type: ignore[arg-type]


def test_eviction_on_a_full_disk_shrinks_its_batches_then_grows_them() -> None:
    store = _TightStore(fits=2, blocks=50)
    capacity = Capacity(store, limits=CapacityLimits(capacity_blocks=0))  # type: ignore[arg-type]
    evicted = capacity._in_batches(lambda size: store.evict(now=0.0, max_blocks=size), now=0.0)
    assert len(evicted) == 50
    assert store.sizes[0] == EVICT_BATCH_BLOCKS and 2 in store.sizes  # down, then up again


def test_eviction_that_cannot_delete_even_one_block_says_disk_full() -> None:
    store = _TightStore(fits=0, blocks=50)
    capacity = Capacity(store, limits=CapacityLimits(capacity_blocks=0))  # type: ignore[arg-type]
    with pytest.raises(DiskFull):
        capacity._in_batches(lambda size: store.evict(now=0.0, max_blocks=size), now=0.0)


def test_enforcing_the_capacity_on_a_full_disk_leaves_the_rest_for_later() -> None:
    store = _TightStore(fits=0, blocks=50)
    capacity = Capacity(store, limits=CapacityLimits(capacity_blocks=10))  # type: ignore[arg-type]
    store.usage = lambda: StoreUsage(blocks=50, payload_bytes=50, used_bytes=50)  # type: ignore[attr-defined]
    assert capacity.enforce() == []


def test_a_purge_on_a_full_disk_gives_the_reserve_up_and_runs_again(tmp_path: Path) -> None:
    store = LmdbStore(tmp_path / "lmdb", map_size_bytes=MAP_BYTES)
    capacity = Capacity(store, limits=CapacityLimits(capacity_bytes=MAP_BYTES))
    assert capacity.reserve is not None
    capacity.reserve.size_bytes = 4096
    assert capacity.reserve.ensure() and capacity.reserve.held
    calls: list[int] = []

    def purge() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise DiskFull("no room")
        return "purged"

    assert capacity.on_full_disk(purge) == "purged"
    assert not capacity.reserve.held and len(calls) == 2
    with pytest.raises(DiskFull):  # no reserve left: the refusal stands
        capacity.on_full_disk(lambda: (_ for _ in ()).throw(DiskFull("no room")))
    store.close()


def test_the_reserve_is_made_only_with_room_for_it_and_the_margin(tmp_path: Path) -> None:
    reserve = DiskReserve(tmp_path)
    reserve.size_bytes = 1 << 62  # more than any disk
    assert not reserve.ensure() and not reserve.held
    assert not list(tmp_path.iterdir())  # no partial file left behind
    reserve.size_bytes = 4096
    assert reserve.ensure() and reserve.path.stat().st_size == 4096
    assert reserve.release() and not reserve.release()


# -- the capacity against the disk ------------------------------------------------------------


def test_the_store_evicts_at_what_the_disk_can_back_less_the_margin() -> None:
    short = room(10 * 2**20, file_bytes=20 * 2**20, capacity_bytes=1 << 30)
    assert short.backed_bytes == 30 * 2**20
    assert short.shortfall_bytes == (1 << 30) - 30 * 2**20
    assert short.limit_bytes == 29 * 2**20
    assert not short.full and room(2**19).full
    fits = room(1 << 40, capacity_bytes=1 << 30)
    assert fits.shortfall_bytes == 0 and "--capacity" not in fits.describe()


def test_capacity_limit_is_the_capacity_or_less_where_the_disk_cannot_back_it(
    tmp_path: Path,
) -> None:
    store = LmdbStore(tmp_path / "lmdb", map_size_bytes=MAP_BYTES)
    small = Capacity(store, limits=CapacityLimits(capacity_bytes=2**20))
    assert small.limit_bytes() == 2**20
    huge = Capacity(store, limits=CapacityLimits(capacity_bytes=1 << 60))
    measured = huge.disk()
    assert measured is not None and measured.shortfall_bytes > 0
    limit = huge.limit_bytes()
    assert limit is not None and limit < 1 << 60
    store.close()


def test_the_disk_warning_is_rate_limited_and_says_when_it_is_over(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    warning = DiskWarning(every_seconds=60.0, clock=lambda: now[0])
    short = DiskRoom(Path("/rate-limited"), 0, 10, 1 << 30, 2**20)
    with caplog.at_level(logging.INFO, logger="cache_service"):
        assert warning.check(short)
        now[0] = 30.0
        assert not warning.check(short)
        now[0] = 61.0
        assert warning.check(short)
        assert not warning.check(DiskRoom(Path("/rate-limited"), 1 << 40, 10, 2**20, 2**20))
    assert sum("more than this disk can hold" in r.message for r in caplog.records) == 2
    assert any("disk room is back" in r.message for r in caplog.records)


# -- background jobs meet a full disk ---------------------------------------------------------


def test_a_job_failing_for_a_full_disk_logs_once_and_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs: list[int] = []

    async def job() -> None:
        runs.append(1)
        if len(runs) < 5:
            raise DiskFull("the file system is full")

    async def run() -> None:
        task = asyncio.create_task(repeat(0.001, job, "touch flush"))
        while len(runs) < 6:
            await asyncio.sleep(0.001)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level(logging.INFO, logger="cache_service"):
        asyncio.run(run())
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "full" in warnings[0].message
    assert not any(r.exc_info for r in caplog.records)  # no traceback for a known condition
    assert any("runs again" in r.message for r in caplog.records)


def test_partial_reserves_of_dead_processes_are_removed_and_live_ones_kept(
    tmp_path: Path,
) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its PID names no running process (short of reuse, in this test)
    leaked = tmp_path / f"disk-reserve.{dead.pid}.tmp"
    live = tmp_path / f"disk-reserve.{os.getppid()}.tmp"  # a running process (the parent)
    garbled = tmp_path / "disk-reserve.x.tmp"
    for partial in (leaked, live, garbled):
        partial.write_bytes(b"\0" * 4096)
    reserve = DiskReserve(tmp_path)
    reserve.size_bytes = 4096
    assert reserve.ensure() and reserve.held
    assert not leaked.exists() and not garbled.exists()
    assert live.exists()  # a running process may be writing it (workers share the folder)
    assert remove_stale_partials(tmp_path) == 0


def test_the_held_reserve_counts_as_the_margin_not_beside_it(tmp_path: Path) -> None:
    margin = 6 * 2**20  # the observed case: a 48 MiB disk, a 7.5 MiB data file, filled
    without = DiskRoom(tmp_path, 0, 15 * 2**19, 1 << 30, margin)
    assert without.limit_bytes == 15 * 2**19 - margin  # no reserve: free room is the margin
    held = DiskRoom(tmp_path, 0, 15 * 2**19, 1 << 30, margin, margin)
    assert held.limit_bytes == 15 * 2**19  # the reserve holds the margin: no eviction to 1.5
    assert DiskRoom(tmp_path, 2**20, 2**20, 1 << 30, margin, 2**20).limit_bytes == 0
    # measure_room finds the reserve file in the folder.
    (tmp_path / RESERVE_NAME).write_bytes(b"\0" * 4096)
    measured = measure_room(tmp_path, 2**20, 1 << 30)
    assert measured.reserve_bytes == 4096
    assert measured.limit_bytes == measured.backed_bytes - (measured.margin_bytes - 4096)


def test_a_start_removes_a_leaked_partial_reserve_even_with_the_reserve_in_place(
    tmp_path: Path,
) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / RESERVE_NAME).write_bytes(b"\0" * 4096)  # another worker made the reserve
    leaked = tmp_path / f"disk-reserve.{dead.pid}.tmp"
    leaked.write_bytes(b"\0" * 4096)
    DiskReserve(tmp_path)
    assert not leaked.exists()
