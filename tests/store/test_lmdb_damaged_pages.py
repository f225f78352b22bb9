"""LMDB's own pages damaged: reads and writes answer StorageFailure (a 503 naming the folder
and the recovery step), never an unmapped lmdb.CorruptedError (a 500)."""

from __future__ import annotations

from pathlib import Path

import lmdb
import pytest

from cache_service.core.blocks import Namespace
from cache_service.core.cache import PrefixCache
from cache_service.core.config import CacheConfig
from cache_service.core.errors import StorageFailure
from cache_service.core.retention import DEFAULT_LIFETIMES
from cache_service.core.store.lmdb.disk import write_error
from cache_service.core.store.lmdb.store import LmdbStore

MAP_BYTES = 64 * 2**20
BLOCK = 16
NAMESPACE = Namespace("m")
FLAGS_AT = 10  # LMDB's page header: pgno (8 bytes), pad (2), flags (2)
P_LEAF = 0x02


def clock() -> float:
    return 1_000_000.0


def prompt(number: int) -> list[int]:
    """Tokens no other prompt shares (so their bytes mark the pages holding its records)."""
    return [0x5A000000 + number * 1000 + t for t in range(4 * BLOCK)]


def damage_leaves_holding(data_file: Path, marker: bytes) -> int:
    """Clear the flags of every leaf page holding `marker`; the pages damaged."""
    data = bytearray(data_file.read_bytes())
    psize = 4096  # LMDB's page size: the OS page on the test machines (checked below)
    damaged = 0
    for start in range(2 * psize, len(data), psize):  # pages 0 and 1 are the meta pages
        page = data[start : start + psize]
        flags = int.from_bytes(page[FLAGS_AT : FLAGS_AT + 2], "little")
        if flags & P_LEAF and marker in page:
            data[start + FLAGS_AT : start + FLAGS_AT + 2] = b"\0\0"
            damaged += 1
    data_file.write_bytes(bytes(data))
    return damaged


def test_a_damaged_page_gives_storage_failure_on_read_and_write(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    store = LmdbStore(folder, map_size_bytes=MAP_BYTES, lifetimes=DEFAULT_LIFETIMES)
    assert store.env.stat()["psize"] == 4096
    cache = PrefixCache(store, config=CacheConfig(default_block_size=BLOCK), clock=clock)
    for number in range(200):  # enough records for the blocks table to have many leaves
        cache.insert(NAMESPACE, prompt(number), [b"kv"] * 4)
    store.close()
    first_block = b"".join(t.to_bytes(4, "little") for t in prompt(7)[:BLOCK])
    assert damage_leaves_holding(folder / "data.mdb", first_block) >= 1

    store = LmdbStore(folder, map_size_bytes=MAP_BYTES, lifetimes=DEFAULT_LIFETIMES)
    try:
        cache = PrefixCache(store, config=CacheConfig(default_block_size=BLOCK), clock=clock)
        with pytest.raises(StorageFailure) as read:
            cache.match_prefix(NAMESPACE, prompt(7))
        assert str(folder) in str(read.value) and "stop the service" in str(read.value)
        with pytest.raises(StorageFailure):  # a write transaction reading the damaged leaf
            cache.insert(NAMESPACE, prompt(7), [b"kv"] * 4)
    finally:
        store.close()


@pytest.mark.parametrize("error", [lmdb.CorruptedError, lmdb.PageNotFoundError])
def test_a_write_finding_damaged_pages_gives_storage_failure(
    tmp_path: Path, error: type[lmdb.Error]
) -> None:
    mapped = write_error(error("mdb_put: MDB_CORRUPTED"), tmp_path)
    assert isinstance(mapped, StorageFailure) and mapped.status == 503
    assert str(tmp_path) in str(mapped) and "remove the folder" in str(mapped)
