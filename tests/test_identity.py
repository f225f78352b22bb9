"""The settings a store's data was made with: recorded on first open, refused if one that
defines the data differs, logged if one that steers it changed."""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import memory_store_for

from cache_service.core.blocks import Namespace
from cache_service.core.cache import PrefixCache
from cache_service.core.config import CacheConfig
from cache_service.core.errors import SettingsMismatch, StorageError
from cache_service.core.hashing import HASH_SCHEME, HASH_VERSION, seed_fingerprint
from cache_service.core.identity import StoreIdentity, identity_of
from cache_service.core.retention import DEFAULT_LIFETIMES
from cache_service.core.store.lmdb.store import LmdbStore
from cache_service.core.store.memory import MemoryStore
from cache_service.service.api.app import create_app
from cache_service.service.settings import Settings

MAP_SIZE_BYTES = 64 * 2**20
WHERE = "/data/cache"


def identity(**changes: Any) -> StoreIdentity:
    """The identity of the default settings, with some changed."""
    values: dict[str, Any] = {
        "seed": "prompt-cache-v1",
        "default_block_size": 64,
        "model_block_sizes": {"llama-3-8b": 16},
        "retention_ttl_seconds": {"agent": 3 * 86400.0, "chat": 7 * 86400.0},
        "capacity_bytes": 20 * 2**30,
        "high_water": 0.95,
        "low_water": 0.85,
        "eviction_policy": "lru",
    }
    values.update(changes)
    return identity_of(**values)


def recorded(**changes: Any) -> bytes:
    """The record a new store keeps for these settings."""
    return identity(**changes).settle(None, where=WHERE)


# -- the comparison ---------------------------------------------------------------------------


def test_new_store_records_every_setting_and_says_so_without_the_seed() -> None:
    fresh = identity()
    record = json.loads(fresh.settle(None, where=WHERE))
    assert record == {
        "seed": "prompt-cache-v1",
        "hash_scheme": f"{HASH_SCHEME} v{HASH_VERSION}",
        "block_size": 64,
        "model_block_size": {"llama-3-8b": 16},
        "retention": {"agent": 259200.0, "chat": 604800.0},
        "capacity": 20 * 2**30,
        "high_water": 0.95,
        "low_water": 0.85,
        "eviction_policy": "lru",
    }
    [note] = fresh.notes
    assert note.startswith(f"data folder {WHERE} had no record of the settings")
    assert "--block-size 64" in note and "--capacity 20 GiB" in note
    assert seed_fingerprint("prompt-cache-v1") in note
    assert "prompt-cache-v1" not in note  # log lines show the seed's fingerprint only


def test_same_settings_keep_the_record_and_say_nothing() -> None:
    again = identity()
    assert again.settle(recorded(), where=WHERE) == recorded()
    assert again.notes == []


@pytest.mark.parametrize(
    ("changes", "label", "stored", "requested"),
    [
        ({"seed": "team-b"}, "--seed", "'prompt-cache-v1'", "'team-b'"),
        ({"default_block_size": 32}, "--block-size", "64", "32"),
        ({"model_block_sizes": {"llama-3-8b": 32}}, "--model-block-size", "llama-3-8b=16",
         "llama-3-8b=32"),
        ({"model_block_sizes": {}}, "--model-block-size", "llama-3-8b=16", "none"),
    ],
)  # fmt: skip
def test_a_setting_that_defines_the_data_refuses_naming_both_values(
    changes: dict[str, Any], label: str, stored: str, requested: str
) -> None:
    with pytest.raises(SettingsMismatch) as refused:
        identity(**changes).settle(recorded(), where=WHERE)
    message = str(refused.value)
    assert f"  {label}: stored {stored}, requested {requested}" in message.splitlines()
    assert WHERE in message and "another --data-dir" in message
    assert len(refused.value.extensions["settings"]) == 1


def test_another_eviction_policy_is_adopted_and_logged() -> None:
    # Every policy ranks on the use sequence: the index stays ordered across a change.
    opener = identity()
    kept = json.loads(opener.settle(recorded(eviction_policy="adaptive"), where=WHERE))
    assert kept["eviction_policy"] == "lru"
    assert any(
        "--eviction-policy changed since the last run: adaptive -> lru; blocks keep the rank "
        "the old policy gave them until their next use" in note
        for note in opener.notes
    )


def test_a_policy_change_beside_a_key_setting_that_differs_refuses_for_the_key_only() -> None:
    with pytest.raises(SettingsMismatch) as refused:
        identity(seed="other").settle(recorded(eviction_policy="adaptive"), where=WHERE)
    assert refused.value.extensions["settings"] == ["seed"]
    assert "Keys made with other values" in str(refused.value).splitlines()[-1]


def test_a_record_made_before_the_policy_was_recorded_adopts_the_current_one() -> None:
    record = json.loads(recorded())
    del record["eviction_policy"]
    opener = identity()
    kept = json.loads(opener.settle(json.dumps(record).encode(), where=WHERE))
    assert kept["eviction_policy"] == "lru"
    assert opener.notes == [
        f"data folder {WHERE} had no record of some settings: recorded this process's: "
        "--eviction-policy lru"
    ]


def test_another_hash_scheme_refuses_and_says_a_build_must_compute_it() -> None:
    record = json.loads(recorded())
    record["hash_scheme"] = f"{HASH_SCHEME} v0"
    with pytest.raises(SettingsMismatch) as refused:
        identity().settle(json.dumps(record).encode(), where=WHERE)
    assert f"hash scheme: stored {HASH_SCHEME} v0, requested {HASH_SCHEME} v1" in str(refused.value)
    assert "a build that computes it" in str(refused.value)


def test_every_differing_setting_is_named_at_once_and_none_is_recorded() -> None:
    opener = identity(seed="other", default_block_size=16, capacity_bytes=2**30)
    with pytest.raises(SettingsMismatch) as refused:
        opener.settle(recorded(), where=WHERE)
    assert refused.value.extensions["settings"] == ["seed", "block_size"]
    assert opener.notes == []


def test_an_override_equal_to_the_default_block_size_is_no_override() -> None:
    same = identity(model_block_sizes={"llama-3-8b": 16, "qwen": 64})
    record = json.loads(same.settle(recorded(), where=WHERE))
    assert record["model_block_size"] == {"llama-3-8b": 16, "qwen": 64}
    assert same.notes == []
    with pytest.raises(SettingsMismatch, match="requested llama-3-8b=16,qwen=32"):
        identity(model_block_sizes={"llama-3-8b": 16, "qwen": 32}).settle(
            json.dumps(record).encode(), where=WHERE
        )


def test_a_lower_capacity_is_recorded_and_logged_with_its_consequence() -> None:
    smaller = identity(capacity_bytes=10 * 2**30)
    record = json.loads(smaller.settle(recorded(), where=WHERE))
    assert record["capacity"] == 10 * 2**30
    assert smaller.notes == [
        "--capacity changed since the last run: 20 GiB -> 10 GiB; blocks over it will be evicted"
    ]
    larger = identity(capacity_bytes=40 * 2**30, high_water=0.9)
    larger.settle(recorded(), where=WHERE)
    assert larger.notes == [
        "--capacity changed since the last run: 20 GiB -> 40 GiB",
        "--high-water changed since the last run: 0.95 -> 0.9",
    ]


def test_retention_changes_are_logged_not_refused() -> None:
    # Blocks keep their absolute expiry and their class name; no stored class is looked up
    # again, so a removed class or a shorter TTL leaves stored blocks as they were.
    changed = identity(retention_ttl_seconds={"chat": 14 * 86400.0, "batch": 7200.0})
    record = json.loads(changed.settle(recorded(), where=WHERE))
    assert record["retention"] == {"chat": 1209600.0, "batch": 7200.0}
    assert changed.notes == [
        "--retention changed since the last run: agent=3d,chat=7d -> batch=2h,chat=14d; "
        "blocks stored before keep the expiry they were given (also those of the removed agent)"
    ]
    added = identity(retention_ttl_seconds={"agent": 3 * 86400.0, "chat": 7 * 86400.0, "b": 60})
    added.settle(recorded(), where=WHERE)
    assert added.notes == [
        "--retention changed since the last run: agent=3d,chat=7d -> agent=3d,b=1m,chat=7d"
    ]


def test_a_record_lacking_a_field_adopts_it_and_keeps_fields_it_does_not_know() -> None:
    record = json.loads(recorded())
    del record["low_water"]
    record["compression"] = "written by a later build"
    opener = identity()
    kept = json.loads(opener.settle(json.dumps(record).encode(), where=WHERE))
    assert kept["low_water"] == 0.85
    assert kept["compression"] == "written by a later build"
    assert opener.notes == [
        f"data folder {WHERE} had no record of some settings: recorded this process's: "
        "--low-water 0.85"
    ]


def test_an_unreadable_record_is_a_storage_error() -> None:
    with pytest.raises(StorageError, match="not a JSON object"):
        identity().settle(b"[1, 2]", where=WHERE)


# -- the LMDB backend keeps the record --------------------------------------------------------


def open_lmdb(folder: Path, opener: StoreIdentity | None) -> LmdbStore:
    """The LMDB store of `folder`, checked against `opener` if given (for caches with the
    default retention classes)."""
    return LmdbStore(
        folder,
        map_size_bytes=MAP_SIZE_BYTES,
        sync_mode="nosync",
        identity=opener,
        lifetimes=DEFAULT_LIFETIMES,
    )


def test_lmdb_refuses_another_seed_and_keeps_the_first_record(tmp_path: Path) -> None:
    open_lmdb(tmp_path, identity()).close()
    with pytest.raises(SettingsMismatch, match="--seed: stored 'prompt-cache-v1'"):
        open_lmdb(tmp_path, identity(seed="other"))
    again = identity()
    open_lmdb(tmp_path, again).close()  # the refused opener left the environment closed
    assert again.notes == []


def test_lmdb_records_a_capacity_change_once(tmp_path: Path) -> None:
    open_lmdb(tmp_path, identity()).close()
    lowered = identity(capacity_bytes=2**30)
    open_lmdb(tmp_path, lowered).close()
    assert lowered.notes == [
        "--capacity changed since the last run: 20 GiB -> 1 GiB; blocks over it will be evicted"
    ]
    next_run = identity(capacity_bytes=2**30)
    open_lmdb(tmp_path, next_run).close()
    assert next_run.notes == []


def test_lmdb_store_made_before_the_record_adopts_the_settings_and_keeps_its_blocks(
    tmp_path: Path,
) -> None:
    older = open_lmdb(tmp_path, None)  # as a build before the record opened it
    PrefixCache(older, config=CacheConfig(default_block_size=64)).insert(
        Namespace("m"), list(range(128)), [b"a"] * 2
    )
    older.close()
    adopting = identity(model_block_sizes={})
    store = open_lmdb(tmp_path, adopting)
    assert "had no record of the settings that define its data" in adopting.notes[0]
    assert PrefixCache(store).match_prefix(Namespace("m"), list(range(128))).matched_blocks == 2
    store.close()
    with pytest.raises(SettingsMismatch, match="--block-size"):
        open_lmdb(tmp_path, identity(default_block_size=16))


def _open_together(folder: str, barrier: Any, results: Any) -> None:
    opener = identity()
    barrier.wait()
    try:
        open_lmdb(Path(folder), opener).close()
        results.put((os.getpid(), opener.notes))
    except Exception as exc:  # reported to the test, which fails on it
        results.put((os.getpid(), [f"failed: {exc!r}"]))


def test_worker_processes_opening_a_new_folder_together_all_start_and_one_records(
    tmp_path: Path,
) -> None:
    processes = 4
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(processes), context.Queue()
    workers = [
        context.Process(target=_open_together, args=(str(tmp_path), barrier, results))
        for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    try:
        notes = [results.get(timeout=60)[1] for _ in workers]
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
                worker.join()
    assert all(not note or "had no record" in note[0] for note in notes), notes
    assert sorted(len(note) for note in notes) == [0, 0, 0, 1]


# -- the service -------------------------------------------------------------------------------


async def _start_and_stop(settings: Settings, store: MemoryStore | None = None) -> None:
    app = create_app(settings, store=store)
    async with app.router.lifespan_context(app):
        pass


def test_service_refuses_a_folder_made_with_another_seed(tmp_path: Path) -> None:
    asyncio.run(_start_and_stop(Settings(data_dir=tmp_path / "data")))
    with pytest.raises(SettingsMismatch, match="--seed"):
        asyncio.run(_start_and_stop(Settings(data_dir=tmp_path / "data", seed="other")))


def test_service_says_what_it_serves_on_start_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="cache_service")
    settings = Settings(data_dir=tmp_path / "data", capacity=2**30, port=8123)
    asyncio.run(_start_and_stop(settings))
    line = (
        f"process {os.getpid()} serves data folder {(tmp_path / 'data').resolve()} "
        "(capacity 1 GiB, auth none) on http://127.0.0.1:8123"
    )
    assert line in caplog.messages


def test_a_memory_store_keeps_no_record_and_any_settings_serve_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="cache_service")
    store = memory_store_for(Settings())  # the second settings hold it to the same
    asyncio.run(_start_and_stop(Settings(), store))
    asyncio.run(_start_and_stop(Settings(seed="other", block_size=16), store))
    assert (
        sum("serves a memory store opened by its caller" in message for message in caplog.messages)
        == 2
    )
