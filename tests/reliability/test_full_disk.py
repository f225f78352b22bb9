"""A full disk: a real server whose data folder is on a small tmpfs, with a --capacity larger
than the disk. It must never answer 500: a write with no room is 507 disk-full, reads go on,
a purge frees room and writes recover, a restart on the full disk works, and the metrics
show the capacity the disk cannot back."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cache_service.core.store.lmdb.store import LmdbStore
from cache_service.core.store.parts.backend import REMOVAL_ORDER
from cache_service.core.store.parts.removals import FLOOR_ENTRIES
from cache_service.service.api.app import create_app
from cache_service.service.settings import Settings
from tests.integration.conftest import ServerProcess
from tests.reliability.small_disk import (
    PROBLEM_JSON,
    Session,
    fill,
    payload,
    prompt_tokens,
    tmpfs,
)
from tests.reliability.thread_server import ThreadServer

DISK_BYTES = 64 * 2**20
BLOCKS = 8  # per prompt
PAYLOAD_BYTES = 64 * 2**10  # a small model's KV block; 512 KiB a prompt


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs, unmounted at teardown (after the test stopped its server)."""
    with tmpfs(tmp_path / "disk", DISK_BYTES) as mount_point:
        yield mount_point


@pytest.fixture
def full_disk_server(small_disk: Path, tmp_path: Path) -> Iterator[ServerProcess]:
    """A server on the small disk, its capacity 1 GiB; stopped before the disk is unmounted."""
    server = ServerProcess(
        small_disk / "data",
        tmp_path / "server.log",
        capacity="1GiB",
        block_size="16",
        touch_flush_interval="0.05",
        sweep_interval="0.2",
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def assert_disk_full(answer_status: int, content_type: str, body: dict[str, object]) -> None:
    """A 507 problem+json that names the full disk."""
    assert answer_status == 507, body
    assert content_type.startswith(PROBLEM_JSON)
    assert str(body["type"]).endswith("/disk-full"), body
    assert "file system" in str(body["detail"]), body


def test_full_disk_answers_507_keeps_reads_and_recovers_after_purge(
    full_disk_server: ServerProcess,
    small_disk: Path,
    scale: Callable[[int, int], int],
    report: Callable[..., None],
) -> None:
    server = full_disk_server
    session = Session(server.url)
    started = time.monotonic()
    try:
        # 1. More than the disk holds, unpinned: the store evicts at what the disk can back.
        unpinned = scale(240, 2000)
        for index in range(unpinned):
            answer = session.store(index, BLOCKS, PAYLOAD_BYTES)
            if answer.status_code != 200:
                assert_disk_full(answer.status_code, answer.headers["content-type"], answer.json())
        stored_unpinned = session.statuses[200]
        evicted = session.metric('prompt_cache_evicted_blocks_total{reason="capacity"}') or 0
        assert evicted > 0
        assert stored_unpinned >= unpinned * 0.9, session.statuses
        assert (session.metric("prompt_cache_disk_shortfall_bytes") or 0) > 0

        # 2. Pinned prompts up to what the disk can back, then another program fills the
        # disk: a store larger than the data file's free pages has no room, nothing can be
        # evicted for it, and it answers 507 disk-full.
        assert session.post("/v1/purge", json={}).status_code == 200
        held: list[int] = []
        for index in range(unpinned, unpinned + 400):
            stored = session.store(index, BLOCKS, PAYLOAD_BYTES)
            if stored.status_code != 200 or stored.json()["stored_blocks"] < BLOCKS:
                break  # at the limit the disk sets, the newest blocks are truncated
            if session.pin(index, BLOCKS).status_code != 200:
                break
            held.append(index)
        assert len(held) > 4, session.statuses
        filler = fill(small_disk / "filler")
        assert os.statvfs(small_disk).f_bavail == 0
        file_bytes = session.metric("prompt_cache_disk_file_bytes") or 0
        used_bytes = session.metric("prompt_cache_bytes") or 0
        big = int((file_bytes - used_bytes) // PAYLOAD_BYTES) + 64  # more than the free pages
        refused = session.store(30_000, big, PAYLOAD_BYTES)
        assert_disk_full(refused.status_code, refused.headers["content-type"], refused.json())
        again = session.store(30_001, big, PAYLOAD_BYTES, binary_tokens=True)  # the same
        assert_disk_full(again.status_code, again.headers["content-type"], again.json())
        # Pins and unpins write too: done, or 507 (the scan at the end finds no 500).
        assert session.pin(held[-1], BLOCKS).status_code in {200, 507}
        unpin = session.post(
            "/v1/unpin", json={"model": "m", "tokens": prompt_tokens(held[-1], BLOCKS)}
        )
        assert unpin.status_code in {200, 507}, unpin.text
        first_pinned = held[0]

        # 3. Reads go on, with the right bytes.
        assert session.matched_blocks(first_pinned, BLOCKS) == BLOCKS
        fetched = session.fetch(first_pinned, BLOCKS)
        assert fetched == [payload(first_pinned, b, PAYLOAD_BYTES) for b in range(BLOCKS)]
        assert session.metric("prompt_cache_disk_free_bytes") == 0
        time.sleep(0.5)  # touch flushes and sweeps run against the full disk
        assert server.proc is not None and server.proc.poll() is None

        # 4. A restart on the full disk opens the store; reads still work, writes still 507.
        server.restart()
        restarted = Session(server.url)
        assert restarted.matched_blocks(first_pinned, BLOCKS) == BLOCKS
        again = restarted.store(40_000, big, PAYLOAD_BYTES)
        assert_disk_full(again.status_code, again.headers["content-type"], again.json())
        assert (restarted.metric("prompt_cache_disk_shortfall_bytes") or 0) > 0

        # 5. A purge frees room inside the data file; stores recover.
        purged = restarted.post("/v1/purge", json={})
        assert purged.status_code == 200, purged.text
        assert purged.json()["blocks"] > 0
        recovered = restarted.store(40_001, BLOCKS, PAYLOAD_BYTES)
        assert recovered.status_code == 200, recovered.text
        assert restarted.matched_blocks(40_001, BLOCKS) == BLOCKS
        assert restarted.fetch(40_001, BLOCKS)[0] == payload(40_001, 0, PAYLOAD_BYTES)

        statuses = session.statuses + restarted.statuses
        server_errors = session.server_errors + restarted.server_errors
        restarted.close()
    finally:
        session.close()
    assert not server_errors, server_errors
    assert set(statuses) <= {200, 409, 507}, statuses
    log = server.log_path.read_text()
    assert "Traceback" not in log, log[-3000:]
    report(
        stores_unpinned=unpinned,
        stored_unpinned=stored_unpinned,
        evicted_for_disk=int(evicted),
        pinned_prompts=len(held),
        filler_bytes=filler,
        statuses=dict(sorted(statuses.items())),
        seconds=round(time.monotonic() - started, 1),
    )


def test_a_tiny_map_evicts_or_answers_507_never_500(
    tmp_path: Path, scale: Callable[[int, int], int], report: Callable[..., None]
) -> None:
    # A 1 MiB LMDB map under a 1 GiB capacity: the map, not the capacity, runs out. No flag
    # sets the map (it is 2 x --capacity + 256 MiB), so the store is opened here and given.
    settings = Settings(
        data_dir=tmp_path / "lmdb", capacity=2**30, block_size=16, touch_flush_interval=0.05
    )
    store = LmdbStore(
        tmp_path / "lmdb",
        map_size_bytes=2**20,
        removal_log_entries=settings.groups.store.removal_log_entries,
        lifetimes=settings.groups.store.lifetimes,
    )
    server = ThreadServer(create_app(settings, store=store), "tiny-map-server")
    server.start()
    session = Session(server.url)
    started = time.monotonic()
    prompts, small = scale(300, 3000), 1500  # small blocks: many leaf pages per eviction
    last_whole = None
    stored: list[int] = []  # the indexes of the stores that answered 200
    try:
        for index in range(prompts):
            answer = session.store(index, BLOCKS, small)
            if answer.status_code == 200:
                stored.append(index)
            if answer.status_code == 200 and answer.json()["stored_blocks"] == BLOCKS:
                last_whole = index
            elif answer.status_code != 200:
                assert answer.status_code == 507, answer.text
                assert answer.headers["content-type"].startswith(PROBLEM_JSON)
        assert last_whole is not None
        assert session.fetch(last_whole, BLOCKS) == [
            payload(last_whole, b, small) for b in range(BLOCKS)
        ]
        too_big = session.store(prompts, BLOCKS, 256 * 2**10)  # 2 MiB: more than the map
        assert too_big.status_code == 507, too_big.text
        evicted = session.metric('prompt_cache_evicted_blocks_total{reason="capacity"}') or 0
        with store.backend.read() as txn:
            log_entries = txn.aux_count(REMOVAL_ORDER)
    finally:
        session.close()
        server.stop()
        store.close()
    assert not session.server_errors, session.server_errors
    assert set(session.statuses) <= {200, 507}, session.statuses
    # Eviction makes room in the map, and the removal log (--removal-log-entries, 2**18 by
    # default, which nothing evicts) keeps to its share of the store: without that bound it
    # took the whole map (the long run: every store 507 after about 1,000 prompts).
    assert sum(index < 100 for index in stored) >= 50, session.statuses
    assert sum(index >= prompts - 100 for index in stored) >= 50, session.statuses
    assert log_entries <= FLOOR_ENTRIES < evicted  # a 1 MiB store's share is below the floor
    report(
        prompts=prompts,
        stored_first_100=sum(index < 100 for index in stored),
        stored_last_100=sum(index >= prompts - 100 for index in stored),
        statuses=dict(sorted(session.statuses.items())),
        evicted=int(evicted),
        removal_log_entries=log_entries,
        seconds=round(time.monotonic() - started, 1),
    )


def test_a_purge_of_many_small_pinned_blocks_runs_on_a_completely_full_disk(
    full_disk_server: ServerProcess,
    small_disk: Path,
    scale: Callable[[int, int], int],
    report: Callable[..., None],
) -> None:
    # Small pinned blocks fill the disk: a purge of 1,024 of them in one transaction needs
    # more fresh pages (11.5-18 MB measured) than the disk's free room and its reserve, so
    # a purge must shrink its batches to start (and grow them again as they free room).
    session = Session(full_disk_server.url)
    started = time.monotonic()
    blocks, small = 64, 1500
    pinned_blocks = 0
    try:
        for index in range(scale(2000, 4000)):
            stored = session.store(index, blocks, small)
            if stored.status_code != 200:
                assert_disk_full(stored.status_code, stored.headers["content-type"], stored.json())
                break
            whole = stored.json()["stored_blocks"] == blocks
            if not whole or session.pin(index, blocks).status_code != 200:
                break  # at the limit the disk sets: the rest of the disk is the filler's
            pinned_blocks += blocks
        filler = fill(small_disk / "filler")
        assert os.statvfs(small_disk).f_bavail == 0
        assert pinned_blocks > 5000, session.statuses  # the disk holds many small blocks
        refused = session.store(40_000, 8, PAYLOAD_BYTES)
        assert_disk_full(refused.status_code, refused.headers["content-type"], refused.json())

        held_blocks = session.metric("prompt_cache_blocks")
        purge_started = time.monotonic()
        purged = session.post("/v1/purge", json={})
        purge_seconds = time.monotonic() - purge_started
        assert purged.status_code == 200, purged.text
        # Every block goes. The answer may count fewer: a purged pin lets go of the blocks
        # above it (a full purge: expiring at once), and the sweeper may take some of those
        # between the purge's batches (counted as expired).
        assert purged.json()["blocks"] > 0
        assert session.metric("prompt_cache_blocks") == 0
        assert session.matched_blocks(0, blocks) == 0
        recovered = [session.store(40_001 + n, BLOCKS, PAYLOAD_BYTES) for n in range(4)]
        assert [answer.status_code for answer in recovered] == [200] * 4, recovered[-1].text
        assert all(answer.json()["stored_blocks"] == BLOCKS for answer in recovered)
        assert session.fetch(40_004, BLOCKS)[-1] == payload(40_004, BLOCKS - 1, PAYLOAD_BYTES)
    finally:
        session.close()
    assert not session.server_errors, session.server_errors
    assert set(session.statuses) <= {200, 507}, session.statuses
    log = full_disk_server.log_path.read_text()
    assert "Traceback" not in log, log[-3000:]
    report(
        reserve_given_up="gave up its" in log,
        pinned_blocks=pinned_blocks,
        held_blocks=held_blocks,
        filler_bytes=filler,
        purged_blocks=purged.json()["blocks"],
        purge_seconds=round(purge_seconds, 1),
        statuses=dict(sorted(session.statuses.items())),
        seconds=round(time.monotonic() - started, 1),
    )
