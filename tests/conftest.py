"""Shared fixtures: a virtual clock, and a `store` fixture run once per BlockStore backend.

A backend is one entry in `BACKENDS` (how to open it) and one in `RAW_ACCESS` (how a test
reads its metadata and damages its payloads behind the protocol's back). Adding Redis is
adding one entry to each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest

from cache_service.core.blocks import BlockMeta, StoreKey
from cache_service.core.store.base import BlockStore
from cache_service.core.store.codec import decode_meta
from cache_service.core.store.lmdb import LmdbStore
from cache_service.core.store.memory import MemoryStore

# Fixtures of real servers following real engine publishers (tests/integration, tests/kv_events).
pytest_plugins = ["tests.kv_events.following"]

LMDB_MAP_SIZE_BYTES = 1 << 30
CLOCK_START = 1_700_000_000.0


class VirtualClock:
    """A clock for tests: calling it returns the current virtual time in seconds."""

    def __init__(self, start: float = CLOCK_START) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move time forward and return the new time."""
        if seconds < 0:
            raise ValueError("a virtual clock never goes back")
        self.now += seconds
        return self.now


@pytest.fixture
def clock() -> VirtualClock:
    """A fresh virtual clock, starting at a realistic epoch time."""
    return VirtualClock()


def open_memory_store(tmp_path: Path) -> BlockStore:
    """A fresh in-memory store (tmp_path unused)."""
    return MemoryStore()


def open_lmdb_store(tmp_path: Path) -> BlockStore:
    """A fresh LMDB store in its own directory under tmp_path."""
    return LmdbStore(tmp_path / "lmdb", map_size_bytes=LMDB_MAP_SIZE_BYTES)


BACKENDS: dict[str, Callable[[Path], BlockStore]] = {
    "memory": open_memory_store,
    "lmdb": open_lmdb_store,
}


@pytest.fixture(params=list(BACKENDS))
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BlockStore]:
    """One empty store per backend; closed when the test ends."""
    opened = BACKENDS[request.param](tmp_path)
    yield opened
    opened.close()


class RawAccess(Protocol):
    """What a test may do to a backend below the BlockStore protocol."""

    def blocks(self) -> dict[StoreKey, BlockMeta]:
        """Every stored block's metadata, expired or not."""
        ...

    def overwrite_payload(self, key: StoreKey, payload: bytes) -> None:
        """Replace a block's payload bytes without updating its checksum."""
        ...


class MemoryRawAccess:
    """Raw access to a MemoryStore's dicts."""

    def __init__(self, store: MemoryStore) -> None:
        self.backend = store.backend

    def blocks(self) -> dict[StoreKey, BlockMeta]:
        return dict(self.backend.metas)

    def overwrite_payload(self, key: StoreKey, payload: bytes) -> None:
        self.backend.payloads[key] = payload


class LmdbRawAccess:
    """Raw access to an LmdbStore's named databases."""

    def __init__(self, store: LmdbStore) -> None:
        self.backend = store.backend

    def blocks(self) -> dict[StoreKey, BlockMeta]:
        with self.backend.env.begin() as txn:
            return {
                StoreKey(bytes(key)): decode_meta(StoreKey(bytes(key)), bytes(record))
                for key, record in txn.cursor(db=self.backend.dbs["blocks"])
            }

    def overwrite_payload(self, key: StoreKey, payload: bytes) -> None:
        with self.backend.env.begin(write=True) as txn:
            txn.put(key, payload, db=self.backend.dbs["payloads"])

    def record(self, key: StoreKey) -> bytes:
        """A block's encoded record, as stored."""
        with self.backend.env.begin() as txn:
            return bytes(txn.get(key, db=self.backend.dbs["blocks"]))

    def overwrite_record(self, key: StoreKey, record: bytes) -> None:
        """Replace a block's record bytes behind the store's back (damage it)."""
        with self.backend.env.begin(write=True) as txn:
            txn.put(key, record, db=self.backend.dbs["blocks"])

    def flip(self, key: StoreKey, offset: int, mask: int = 0x5A) -> None:
        """XOR one byte of a block's record (a negative offset counts from its end)."""
        record = bytearray(self.record(key))
        record[offset] ^= mask
        self.overwrite_record(key, bytes(record))

    def index_entries(self, index: str) -> list[bytes]:
        """Every entry of an ordered index (sort key + stored key)."""
        with self.backend.env.begin() as txn:
            return [bytes(key) for key, _ in txn.cursor(db=self.backend.dbs[index])]


RAW_ACCESS: dict[type, Callable[[Any], RawAccess]] = {
    MemoryStore: MemoryRawAccess,
    LmdbStore: LmdbRawAccess,
}


def raw_access(store: BlockStore) -> RawAccess:
    """The raw access helper for a store's backend."""
    return RAW_ACCESS[type(store)](store)


@pytest.fixture
def raw(store: BlockStore) -> RawAccess:
    """Raw access to the `store` fixture's backend."""
    return raw_access(store)


@pytest.fixture
def raw_of() -> Callable[[BlockStore], RawAccess]:
    """Raw access to any store a test opened itself."""
    return raw_access


# -- the reliability suite's scale and its findings (tests/reliability) --------------------------

FINDINGS: list[str] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--reliability",
        choices=("short", "long"),
        default="short",
        help="tests/reliability at CI scale (short, the default) or at full scale (long)",
    )


@pytest.fixture
def report(request: pytest.FixtureRequest) -> Callable[..., None]:
    """report(**figures): what a reliability test measured, printed in the run's summary."""

    def write(**figures: object) -> None:
        shown = " ".join(f"{name}={value}" for name, value in figures.items())
        FINDINGS.append(f"{request.node.name}: {shown}")

    return write


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print what the reliability suite measured: its counts and times, one line a test."""
    if FINDINGS:
        terminalreporter.write_sep("=", "reliability findings")
        for line in FINDINGS:
            terminalreporter.write_line(line)


# -- real service processes (tests/integration, tests/kv_events, ...) -------------------------


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """A factory of `cache-service serve` processes (tests/integration/conftest.py's
    ServerProcess) on fresh data folders; every one is stopped at teardown, by its PID."""
    from tests.integration.conftest import ServerProcess  # noqa: PLC0415

    started: list[ServerProcess] = []

    def factory(**flags: str) -> ServerProcess:
        index = len(started)
        server = ServerProcess(tmp_path / f"data{index}", tmp_path / f"server{index}.log", **flags)
        started.append(server)
        server.start()
        return server

    yield factory
    for server in started:
        server.stop()
