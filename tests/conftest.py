"""Shared fixtures: a virtual clock, and a `store` fixture run once per BlockStore backend.

A backend is one entry in `BACKENDS` (how to open it) and one in `RAW_ACCESS` (how a test
reads its metadata and damages its payloads behind the protocol's back). The `redis` backend
is a real Redis Cluster (tests/store/redis_backend.py), one for the whole session, started
only when a redis test first runs and flushed before each.

A backend declares the behaviours it lacks in its store class's `capabilities`
(cache_service/core/store/protocols.py); a test that depends on one carries
`@pytest.mark.needs("capability")`: it must pass on every backend that declares it, and is
expected to fail on the others (a pass there shows as XPASS: working, but not declared). A
test facility a backend lacks (tests/store/capabilities.py) skips the test with the reason.

A store is told what it keeps when it is opened, never after: a test (or a module, by its
`pytestmark`) that wants the fixture's store opened with `lifetimes=` (a cache over it needs
its retention's) or `removal_log_entries=` carries `@pytest.mark.store_opened(...)` with them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest

from cache_service.core.blocks import BlockMeta, StoreKey
from cache_service.core.store.lmdb.store import LmdbStore
from cache_service.core.store.memory import MemoryStore
from cache_service.core.store.parts.codec import decode_meta
from cache_service.core.store.protocols import BlockStore
from cache_service.core.store.redis.store import RedisStore
from cache_service.service.settings import Settings
from tests.store.capabilities import ELSEWHERE, lacking, undeclared
from tests.store.redis_backend import RedisRawAccess, open_redis_store, start_contract_cluster

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


def open_memory_store(
    request: pytest.FixtureRequest, tmp_path: Path, **opened_with: Any
) -> BlockStore:
    """A fresh in-memory store."""
    return MemoryStore(**opened_with)


def open_lmdb_store(
    request: pytest.FixtureRequest, tmp_path: Path, **opened_with: Any
) -> BlockStore:
    """A fresh LMDB store in its own directory under tmp_path."""
    return LmdbStore(tmp_path / "lmdb", map_size_bytes=LMDB_MAP_SIZE_BYTES, **opened_with)


def memory_store_for(
    settings: Settings, store_class: type[MemoryStore] = MemoryStore
) -> MemoryStore:
    """A memory store opened as the service holds a store it is given to `settings`: with
    their retention's lifetimes and their removal log's length."""
    opening = settings.groups.store
    return store_class(lifetimes=opening.lifetimes, removal_log_entries=opening.removal_log_entries)


BACKENDS: dict[str, Callable[..., BlockStore]] = {
    "memory": open_memory_store,
    "lmdb": open_lmdb_store,
    "redis": open_redis_store,
}


@pytest.fixture(scope="session")
def contract_redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The redis backend's cluster: started when a redis test first asks for it (forming one
    takes seconds), stopped by PID when the session ends."""
    cluster = start_contract_cluster(tmp_path_factory.mktemp("contract-redis"))
    try:
        yield cluster
    finally:
        cluster.stop()


# What `pytest` alone (no paths, no -m, no --all) leaves out: the tests that start processes
# (services, Redis, engines, browsers) or run whole traces, by marker, by folder, and the
# store contract suite's Redis Cluster backend.
STARTING_MARKERS = (
    "integration",
    "reliability",
    "model",
    "vllm",
    "deploy",
    "eligibility",
    "simulation",
)
STARTING_FOLDERS = tuple(
    f"tests/{name}/"
    for name in (
        "integration",
        "reliability",
        "model",
        "vllm",
        "deploy",
        "redis_cluster",
        "docs_site",
    )
)


def pytest_configure(config: pytest.Config) -> None:
    asked = config.args_source == pytest.Config.ArgsSource.ARGS  # paths named: theirs, all
    if not (config.getoption("all") or config.option.markexpr or asked):
        config.option.markexpr = " and ".join(f"not {name}" for name in STARTING_MARKERS)
        config.option.fast_default = True  # an option: pytest-xdist's workers get it too
    config.addinivalue_line(
        "markers",
        "needs(*capabilities): the test depends on store behaviours some backends declare "
        "they lack (expected to fail there: XPASS if it works) or test facilities some "
        "backends lack (skipped there); see tests/store/capabilities.py",
    )
    config.addinivalue_line(
        "markers",
        "bug_on(backend, reason): a known bug of that backend's store, reported to its "
        "owner; the test is expected to fail there (strictly: a fix makes it fail as XPASS)",
    )
    config.addinivalue_line(
        "markers",
        "store_opened(**options): what the `store` fixture opens its store with "
        "(lifetimes=, removal_log_entries=)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put ELSEWHERE's marks on the tests outside tests/store it names; tests/vllm first."""
    for item in items:
        name = item.nodeid.partition("[")[0]  # tests/test_x.py::test_y, any parameters
        for mark in ELSEWHERE.get(name, ()):
            item.add_marker(mark)
    if config.getoption("fast_default"):
        starting = {id(item) for item in items if _starts_something(item)}
        config.hook.pytest_deselected(items=[item for item in items if id(item) in starting])
        items[:] = [item for item in items if id(item) not in starting]
    # First, so that under pytest-xdist one worker starts on them at once (below).
    items.sort(key=lambda item: work_unit(item.nodeid) != ENGINES_UNIT)  # stable


def _starts_something(item: pytest.Item) -> bool:
    """Under a folder of tests that start processes, or on the Redis Cluster backend."""
    params = getattr(item, "callspec", None)
    return item.nodeid.startswith(STARTING_FOLDERS) or (
        params is not None and params.params.get("store") == "redis"
    )


ENGINES_UNIT = "tests/vllm"


def work_unit(nodeid: str) -> str:
    """What one pytest-xdist worker runs whole: a test's module, whose fixtures (servers,
    engines) its tests share; tests/vllm's modules are one unit, so that one engine runs at
    a time, on a worker of its own."""
    module = nodeid.partition("::")[0]
    return ENGINES_UNIT if module.startswith(ENGINES_UNIT + "/") else module


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under `-n N --dist loadgroup`, hand out work units (above), tests/vllm first: they
    take the longest (about 17 min on 2 cores), and the other workers run the rest beside
    them. (pytest-xdist's own loadgroup renames test ids to group them, which pytest 9 no
    longer allows.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling  # noqa: PLC0415

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False  # keep the collection's order: tests/vllm first
    return ByWorkUnit(config, log)


@pytest.fixture(params=list(BACKENDS))
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BlockStore]:
    """One empty store per backend; closed when the test ends. A test marked `needs(...)`
    a behaviour the backend lacks is skipped with the reason."""
    reasons = lacking(request.param, request.node)
    if reasons:
        pytest.skip(f"not on {request.param}: " + "; ".join(reasons))
    lacks = undeclared(request.param, request.node)
    if lacks:  # a pass shows as XPASS: the backend does what it declares it does not
        reason = f"{request.param} declares it lacks: " + "; ".join(lacks)
        request.applymarker(pytest.mark.xfail(reason=reason, strict=False))
    for mark in request.node.iter_markers("bug_on"):
        backend, reason = mark.args
        if backend == request.param:
            request.applymarker(pytest.mark.xfail(reason=f"{backend} bug: {reason}", strict=True))
    opened_with = request.node.get_closest_marker("store_opened")
    opened = BACKENDS[request.param](
        request, tmp_path, **(opened_with.kwargs if opened_with is not None else {})
    )
    yield opened
    opened.close()


class RawAccess(Protocol):
    """What a test may do to a backend below the BlockStore protocol."""

    # Whether records are kept up in place (children, expiry): what assert_prefix_closed reads.
    records_kept_up: bool

    def blocks(self) -> dict[StoreKey, BlockMeta]:
        """Every stored block's metadata, expired or not."""
        ...

    def seconds_left(self, key: StoreKey, now: float) -> float:
        """How long the block has to live, seen at `now` (the backend's own clock for one
        that expires on the real clock)."""
        ...

    def overwrite_payload(self, key: StoreKey, payload: bytes) -> None:
        """Replace a block's payload bytes without updating its checksum."""
        ...


class MemoryRawAccess:
    """Raw access to a MemoryStore's dicts."""

    records_kept_up = True

    def __init__(self, store: MemoryStore) -> None:
        self.backend = store.backend

    def blocks(self) -> dict[StoreKey, BlockMeta]:
        return dict(self.backend.metas)

    def seconds_left(self, key: StoreKey, now: float) -> float:
        return self.blocks()[key].expires_at - now

    def overwrite_payload(self, key: StoreKey, payload: bytes) -> None:
        self.backend.payloads[key] = payload


class LmdbRawAccess:
    """Raw access to an LmdbStore's named databases."""

    records_kept_up = True

    def __init__(self, store: LmdbStore) -> None:
        self.backend = store.backend

    def seconds_left(self, key: StoreKey, now: float) -> float:
        return self.blocks()[key].expires_at - now

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
    RedisStore: RedisRawAccess,
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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--all",
        action="store_true",
        help="every test (README's command and .ci/run); without it, and without paths or -m, "
        "the tests that start nothing (the development loop's default)",
    )
    parser.addoption("--fast-default", action="store_true", help=argparse.SUPPRESS)
    parser.addoption(
        "--reliability",
        choices=("short", "long"),
        default="short",
        help="tests/reliability at CI scale (short, the default) or at full scale (long)",
    )
    parser.addoption(
        "--eligibility",
        choices=("short", "long"),
        default="short",
        help="tests/test_default_policy.py on the held-out seed (short, the default) or on both",
    )
    parser.addoption(
        "--fleet-trace",
        choices=("short", "long"),
        default="short",
        help="tests/vllm/test_fleet_model.py on the conversation trace's first 100 requests "
        "(short, the default) or its first 240 (long)",
    )


@pytest.fixture
def report(request: pytest.FixtureRequest) -> Callable[..., None]:
    """report(**figures): what a reliability test measured, printed in the run's summary
    (carried in the test's report, so a pytest-xdist worker's findings reach it too)."""

    def write(**figures: object) -> None:
        shown = " ".join(f"{name}={value}" for name, value in figures.items())
        request.node.user_properties.append((FINDING, f"{request.node.name}: {shown}"))

    return write


FINDING = "reliability finding"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print what the reliability suite measured: its counts and times, one line a test."""
    findings = [
        value
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", None) == "call"
        for name, value in getattr(report, "user_properties", ())
        if name == FINDING
    ]
    if findings:
        terminalreporter.write_sep("=", "reliability findings")
        for line in findings:
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
