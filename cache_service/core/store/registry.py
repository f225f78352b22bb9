"""Which backend a store URL names, and how each is opened: a backend is one module plus one
entry in `BACKENDS`.

A store is named by a URL or a plain folder path:

    /var/lib/cache, ./cache-data     a plain folder: the LMDB store in that folder
    lmdb:///var/lib/cache            the same, absolute: everything after "lmdb://" is the path
    lmdb://cache-data                a path relative to the working directory
    memory://                        a store in process memory (one process; gone on exit)

A URL is recognised by "<scheme>://"; anything else is a folder, so existing `--data-dir`
values keep meaning what they meant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cache_service.core.eviction import EvictionPolicy
from cache_service.core.store.base import BlockStore, IdentityCheck
from cache_service.core.store.lmdb import LmdbStore
from cache_service.core.store.memory import MemoryStore

FOLDER_SCHEME = "lmdb"  # what a plain folder path opens


@dataclass(frozen=True)
class StoreOptions:
    """What the opener of any backend may be told; a backend ignores what it has no use for."""

    map_size_bytes: int
    sync_mode: str = "full"
    identity: IdentityCheck | None = None  # checked against a persistent store's record
    policy: EvictionPolicy | None = None
    removal_log_entries: int = 0  # recent removals remembered for explanations (0: none)


@dataclass(frozen=True)
class OpenedStore:
    """An open store and what its opener learned from the registry entry."""

    store: BlockStore
    kind: str  # the registry entry's name: "lmdb", "memory"
    # A folder beside the data for files that every process sharing the store must see (the
    # sweeper's and the metrics port's election locks, quota counters); None when only one
    # process can use the store, so there is nothing to share.
    folder: Path | None
    where: str  # for the start-up line: "data folder /abs/path", "memory://"


Opener = Callable[[str, StoreOptions], OpenedStore]


def _open_lmdb(location: str, options: StoreOptions) -> OpenedStore:
    if not location:
        raise ValueError("an lmdb store needs a folder: lmdb:///absolute/path or lmdb://relative")
    store = LmdbStore(
        location,
        map_size_bytes=options.map_size_bytes,
        sync_mode=options.sync_mode,
        identity=options.identity,
        policy=options.policy,
        removal_log_entries=options.removal_log_entries,
    )
    return OpenedStore(store, "lmdb", store.path, f"data folder {store.path.resolve()}")


def _open_memory(location: str, options: StoreOptions) -> OpenedStore:
    if location:
        raise ValueError(f"memory:// takes no path (got memory://{location})")
    # No identity record: the data lives as long as the process that chose the settings.
    store = MemoryStore(policy=options.policy, removal_log_entries=options.removal_log_entries)
    return OpenedStore(store, "memory", None, "memory://")


BACKENDS: dict[str, Opener] = {
    "lmdb": _open_lmdb,
    "memory": _open_memory,
}


def parse_store_url(url_or_path: str) -> tuple[str, str]:
    """(scheme, location) of a store URL or plain folder path; ValueError naming the known
    schemes for an unknown one."""
    scheme, sep, location = str(url_or_path).partition("://")
    if not sep:
        return FOLDER_SCHEME, str(url_or_path)
    if scheme.lower() not in BACKENDS:
        known = ", ".join(f"{name}://" for name in BACKENDS)
        raise ValueError(
            f"unknown store scheme {scheme!r} in {url_or_path!r} (known: {known}, "
            "or a plain folder path for lmdb)"
        )
    return scheme.lower(), location


def open_store(
    url_or_path: str,
    *,
    map_size_bytes: int,
    sync_mode: str = "full",
    identity: IdentityCheck | None = None,
    policy: EvictionPolicy | None = None,
    removal_log_entries: int = 0,
) -> OpenedStore:
    """Open the store `url_or_path` names (see the module docstring)."""
    scheme, location = parse_store_url(url_or_path)
    options = StoreOptions(map_size_bytes, sync_mode, identity, policy, removal_log_entries)
    return BACKENDS[scheme](location, options)
