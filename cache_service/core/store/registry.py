"""Which backend a store URL names, and how each is opened: a backend is one module plus one
entry in `BACKENDS`.

A store is named by a URL or a plain folder path:

    /var/lib/cache, ./cache-data     a plain folder: the LMDB store in that folder
    lmdb:///var/lib/cache            the same, absolute: everything after "lmdb://" is the path
    lmdb://cache-data                a path relative to the working directory
    memory://                        a store in process memory (one process; gone on exit)
    redis://HOST:PORT[,HOST:PORT]    Redis: a Cluster (any of its nodes) or one node; the
    rediss://HOST:PORT[,...]         same over TLS (store/redis/connect.py: the password
                                     comes from the environment, never the URL)

A URL is recognised by "<scheme>://"; anything else is a folder, so existing `--data-dir`
values keep meaning what they meant. What each backend can do is its store class's declared
`capabilities` (store/protocols.py), which `capabilities_of` tells before opening.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cache_service.core.eviction import EvictionPolicy
from cache_service.core.lifetimes import UNBOUNDED, Lifetimes
from cache_service.core.store.lmdb.store import LmdbStore
from cache_service.core.store.memory import MemoryStore
from cache_service.core.store.protocols import BlockStore, Capabilities, IdentityCheck
from cache_service.core.store.redis.connect import parse_nodes
from cache_service.core.store.redis.store import RedisStore

FOLDER_SCHEME = "lmdb"  # what a plain folder path opens


@dataclass(frozen=True)
class StoreOptions:
    """What the opener of any backend may be told; a backend ignores what it has no use for."""

    map_size_bytes: int
    sync_mode: str = "full"
    identity: IdentityCheck | None = None  # checked against a persistent store's record
    policy: EvictionPolicy | None = None
    removal_log_entries: int = 0  # recent removals remembered for explanations (0: none)
    # Each retention class's TTL, which bounds a block's expiry from now: a cache over the
    # store needs its retention's (`RetentionPolicy.lifetimes()`); UNBOUNDED judges by expiry.
    lifetimes: Lifetimes = UNBOUNDED


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


@dataclass(frozen=True)
class Entry:
    """One backend in the registry: how to open it, what its URL's location must be, and the
    class of the stores it opens (to name a store a caller opened itself)."""

    open: Opener
    location: str  # "folder": a path is needed; "none": the URL takes no path; "hosts"
    store_class: type[LmdbStore | MemoryStore | RedisStore]


def _open_lmdb(location: str, options: StoreOptions) -> OpenedStore:
    store = LmdbStore(
        location,
        map_size_bytes=options.map_size_bytes,
        sync_mode=options.sync_mode,
        identity=options.identity,
        policy=options.policy,
        removal_log_entries=options.removal_log_entries,
        lifetimes=options.lifetimes,
    )
    return OpenedStore(store, "lmdb", store.path, f"data folder {store.path.resolve()}")


def _open_memory(location: str, options: StoreOptions) -> OpenedStore:
    del location  # parse_store_url made sure there is none
    # No identity record: the data lives as long as the process that chose the settings.
    store = MemoryStore(
        policy=options.policy,
        removal_log_entries=options.removal_log_entries,
        lifetimes=options.lifetimes,
    )
    return OpenedStore(store, "memory", None, "memory://")


def _open_redis(location: str, options: StoreOptions, *, tls: bool) -> OpenedStore:
    address = parse_nodes(location, tls=tls)
    store = RedisStore(
        address, policy=options.policy, identity=options.identity, lifetimes=options.lifetimes
    )
    kind = "redis cluster" if store.clustered else "redis"
    return OpenedStore(store, "redis", None, f"{kind} {address.describe()}")


BACKENDS: dict[str, Entry] = {
    "lmdb": Entry(_open_lmdb, "folder", LmdbStore),
    "memory": Entry(_open_memory, "none", MemoryStore),
    "redis": Entry(
        lambda where, options: _open_redis(where, options, tls=False), "hosts", RedisStore
    ),
    "rediss": Entry(
        lambda where, options: _open_redis(where, options, tls=True), "hosts", RedisStore
    ),
}


def parse_store_url(url_or_path: str) -> tuple[str, str]:
    """(scheme, location) of a store URL or plain folder path; ValueError naming the known
    schemes for an unknown one, or saying what the location lacks or has too much of."""
    scheme, sep, location = str(url_or_path).partition("://")
    if not sep:
        scheme, location = FOLDER_SCHEME, str(url_or_path)
    scheme = scheme.lower()
    entry = BACKENDS.get(scheme)
    if entry is None:
        known = ", ".join(f"{name}://" for name in BACKENDS)
        raise ValueError(
            f"unknown store scheme {scheme!r} in {url_or_path!r} (known: {known}, "
            "or a plain folder path for lmdb)"
        )
    if entry.location == "folder" and not location:
        raise ValueError(
            f"{scheme}:// needs a folder: {scheme}:///absolute/path or {scheme}://relative"
        )
    if entry.location == "hosts":
        parse_nodes(location, tls=scheme == "rediss")  # ValueError naming what is wrong
    if entry.location == "none" and location:
        raise ValueError(f"{scheme}:// takes no path (got {url_or_path!r})")
    return scheme, location


def capabilities_of(url_or_path: str) -> Capabilities:
    """What the backend `url_or_path` names can do, declared by its store class."""
    return BACKENDS[parse_store_url(url_or_path)[0]].store_class.capabilities


def describe_store(store: BlockStore) -> OpenedStore:
    """A store its caller opened (tests, embedders): named by the entry whose class it is,
    with no folder for shared files; the caller closes it."""
    kind = next(
        (name for name, entry in BACKENDS.items() if isinstance(store, entry.store_class)),
        type(store).__name__,
    )
    return OpenedStore(store, kind, None, f"a {kind} store opened by its caller")


def open_store(
    url_or_path: str,
    *,
    map_size_bytes: int,
    sync_mode: str = "full",
    identity: IdentityCheck | None = None,
    policy: EvictionPolicy | None = None,
    removal_log_entries: int = 0,
    lifetimes: Lifetimes = UNBOUNDED,
) -> OpenedStore:
    """Open the store `url_or_path` names (see the module docstring), with what it is told
    for as long as it is open (see StoreOptions)."""
    scheme, location = parse_store_url(url_or_path)
    options = StoreOptions(
        map_size_bytes=map_size_bytes,
        sync_mode=sync_mode,
        identity=identity,
        policy=policy,
        removal_log_entries=removal_log_entries,
        lifetimes=lifetimes,
    )
    return BACKENDS[scheme].open(location, options)
