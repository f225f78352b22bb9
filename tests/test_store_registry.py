"""Store URLs: which backend each names, what the opener learns, and unknown schemes."""

from __future__ import annotations

from pathlib import Path

import pytest

from cache_service.core.eviction import LruPolicy
from cache_service.core.lifetimes import UNBOUNDED, Lifetimes
from cache_service.core.store.lmdb.store import LmdbStore
from cache_service.core.store.memory import MemoryStore
from cache_service.core.store.registry import (
    BACKENDS,
    describe_store,
    open_store,
    parse_store_url,
)

MAP_SIZE_BYTES = 64 * 2**20


def test_a_plain_folder_is_an_lmdb_store_with_its_folder_for_shared_files(tmp_path: Path) -> None:
    opened = open_store(str(tmp_path / "data"), map_size_bytes=MAP_SIZE_BYTES)
    try:
        assert isinstance(opened.store, LmdbStore)
        assert opened.kind == "lmdb"
        assert opened.folder == tmp_path / "data"
        assert opened.where == f"data folder {(tmp_path / 'data').resolve()}"
    finally:
        opened.store.close()


def test_an_lmdb_url_takes_an_absolute_path_after_the_scheme(tmp_path: Path) -> None:
    assert parse_store_url(f"lmdb://{tmp_path}/data") == ("lmdb", f"{tmp_path}/data")
    opened = open_store(f"lmdb://{tmp_path}/data", map_size_bytes=MAP_SIZE_BYTES)
    opened.store.close()
    assert (tmp_path / "data" / "data.mdb").exists()


def test_an_lmdb_url_without_a_leading_slash_is_relative_to_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    opened = open_store("lmdb://relative/data", map_size_bytes=MAP_SIZE_BYTES)
    opened.store.close()
    assert (tmp_path / "relative" / "data" / "data.mdb").exists()


def test_an_lmdb_url_needs_a_path_and_a_memory_url_takes_none() -> None:
    with pytest.raises(ValueError, match="needs a folder"):
        open_store("lmdb://", map_size_bytes=MAP_SIZE_BYTES)
    with pytest.raises(ValueError, match="takes no path"):
        parse_store_url("memory://elsewhere")


def test_a_store_its_caller_opened_is_named_by_its_registry_entry(tmp_path: Path) -> None:
    lmdb_store = LmdbStore(tmp_path, map_size_bytes=MAP_SIZE_BYTES)
    try:
        described = describe_store(lmdb_store)
        assert (described.kind, described.folder) == ("lmdb", None)
    finally:
        lmdb_store.close()
    assert describe_store(MemoryStore()).kind == "memory"


def test_memory_is_one_process_store_with_no_folder() -> None:
    opened = open_store("memory://", map_size_bytes=MAP_SIZE_BYTES, removal_log_entries=10)
    assert isinstance(opened.store, MemoryStore)
    assert (opened.kind, opened.folder, opened.where) == ("memory", None, "memory://")
    assert opened.store.removal_log_entries == 10
    with pytest.raises(ValueError, match="takes no path"):
        open_store("memory://somewhere", map_size_bytes=MAP_SIZE_BYTES)


def test_the_opener_passes_the_policy_the_removal_log_size_and_the_lifetimes(
    tmp_path: Path,
) -> None:
    policy, lifetimes = LruPolicy(), Lifetimes({"chat": 60.0})
    for url in (str(tmp_path), "memory://"):
        opened = open_store(
            url,
            map_size_bytes=MAP_SIZE_BYTES,
            policy=policy,
            removal_log_entries=7,
            lifetimes=lifetimes,
        )
        try:
            assert opened.store.policy is policy
            assert opened.store.removal_log_entries == 7
            assert opened.store.lifetimes == lifetimes
        finally:
            opened.store.close()
    assert open_store("memory://", map_size_bytes=MAP_SIZE_BYTES).store.lifetimes is UNBOUNDED


def test_an_unknown_scheme_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError) as refused:
        parse_store_url("valkey://cache:6379")
    message = str(refused.value)
    assert "'valkey'" in message
    assert all(f"{name}://" in message for name in BACKENDS)
