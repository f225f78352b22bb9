"""The replay predicts the service: one request sequence through a running service and
through the replay's embedded cache hits (so evicts) the same blocks, under every policy.

The service side is the real thing: `create_app` from the service's settings (its store
URL, capacity, water marks and `--eviction-policy`) under uvicorn on 127.0.0.1, driven over
HTTP by the client, as a worker would: look up, then store what missed. Two things are held
still so that the two runs see the same sequence of store operations: the clock (a virtual
one, the trace's, as the replay's) and the moment deferred touches are applied (the test
flushes them after each lookup; a server does so every --touch-flush-interval, 0.2 s).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from bench.eviction_traces import generate
from cache_service.client import CacheClient
from cache_service.core.blocks import Namespace
from cache_service.core.cache import PrefixCache
from cache_service.core.config import CacheConfig
from cache_service.core.eviction import POLICIES
from cache_service.core.retention import DEFAULT_LIFETIMES, RetentionPolicy
from cache_service.core.store.memory import MemoryStore
from cache_service.core.tokens import bytes_to_tokens, tokens_to_bytes
from cache_service.service.api.app import create_app
from cache_service.service.settings import Settings
from cache_service.tools.replay.block_units import plan_units, request_namespace, request_tokens
from cache_service.tools.replay.engine import EmbeddedOptions, VirtualClock, replay_embedded
from cache_service.tools.replay.stats import Outcome
from cache_service.tools.replay.traces import TraceRequest, read_trace
from tests.integration.conftest import free_port

BLOCK = 512  # the trace's block: one cache block per hash id on both sides
PAYLOAD = bytes(BLOCK)  # one byte per token: every block takes the same room
CAPACITY_BLOCKS = 300  # well below the trace's distinct blocks: eviction all along
SECONDS_APART = 2.0  # above the service's 1 s touch resolution: every hit is recorded


@pytest.fixture(scope="module")
def requests(tmp_path_factory: pytest.TempPathFactory) -> list[TraceRequest]:
    """About 240 requests of tenants with their own system prompts and follow-ups."""
    path = tmp_path_factory.mktemp("parity") / "tenants.jsonl"
    lines = generate("tenants", seed=3, scale=0.04)
    with path.open("w") as out:
        for index, line in enumerate(lines):
            out.write(json.dumps({**line, "timestamp": index * SECONDS_APART * 1000}) + "\n")
    read = list(read_trace(path, strict=True))
    assert all(isinstance(request, TraceRequest) for request in read)
    return read  # type: ignore[return-value]


def block_bytes() -> int:
    """The room one block takes in a memory store, measured by storing one."""
    store = MemoryStore(lifetimes=DEFAULT_LIFETIMES)
    cache = PrefixCache(
        store, config=CacheConfig(default_block_size=BLOCK, retention=RetentionPolicy())
    )
    namespace = Namespace(model="m", kv_layout="trace-ids:0")
    cache.lookup_and_fill(namespace, tokens_to_bytes(range(BLOCK)), payload=PAYLOAD)
    used = store.usage().used_bytes
    store.close()
    return used


def replayed_hits(requests: list[TraceRequest], policy: str) -> list[int]:
    """Blocks each request hit in the replay's embedded cache (memory store)."""
    hits: list[int] = []

    def note(outcome: Outcome, retention: str) -> None:
        hits.append(outcome.hit_blocks)

    options = EmbeddedOptions(
        units=plan_units(requests, BLOCK),
        retention=RetentionPolicy(),
        capacity_tokens=CAPACITY_BLOCKS * BLOCK,
        policy=policy,
        payload_bytes_per_token=1,
        store="memory",
    )
    replay_embedded(requests, options, note)
    return hits


class InThreadServer:
    """uvicorn serving one app on 127.0.0.1 in a thread; stopped by `close`."""

    def __init__(self, app: object) -> None:
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")  # type: ignore[arg-type]
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def close(self) -> None:
        """Ask uvicorn to stop and wait for it."""
        self.server.should_exit = True
        self.thread.join(timeout=20)
        assert not self.thread.is_alive()


@pytest.fixture
def service_for() -> Iterator[object]:
    """A factory of running services, each closed at the end of the test."""
    running: list[InThreadServer] = []

    def start(policy: str, clock: VirtualClock) -> tuple[InThreadServer, object]:
        settings = Settings(
            store="memory://",
            capacity=CAPACITY_BLOCKS * block_bytes(),
            high_water=1.0,
            low_water=1.0,
            eviction_policy=policy,
            block_size=BLOCK,
            touch_flush_interval=3600.0,  # the test applies touches itself, after each lookup
        )  # type: ignore[call-arg]
        app = create_app(settings, clock=clock)
        server = InThreadServer(app)
        running.append(server)
        return server, app

    yield start
    for server in running:
        server.close()


def served_hits(
    requests: list[TraceRequest], policy: str, service_for: object
) -> tuple[list[int], int]:
    """Blocks each request hit through a running service, and the evictions it counted."""
    clock = VirtualClock()
    server, app = service_for(policy, clock)  # type: ignore[operator]
    hits, stored = [], 0
    with CacheClient(f"http://127.0.0.1:{server.port}", timeout=30) as client:
        for request in requests:
            clock.now = request.timestamp
            namespace = request_namespace(request)
            tokens = bytes_to_tokens(request_tokens(request))
            found = client.lookup(
                request.model, tokens, kv_layout=namespace.kv_layout, salt=namespace.salt
            )
            app.state.service.cache.touches.flush()  # type: ignore[attr-defined]
            missing = len(tokens) // BLOCK - found.matched_blocks
            if missing:
                stored += client.put_prefix(
                    request.model,
                    tokens,
                    [PAYLOAD] * missing,
                    kv_layout=namespace.kv_layout,
                    start_block=found.matched_blocks,
                    salt=namespace.salt,
                )
            hits.append(found.matched_blocks)
        held = int(client.stats()["blocks"])
    return hits, stored - held  # nothing expires (TTLs of days): every block gone was evicted


@pytest.mark.parametrize("policy", list(POLICIES))
def test_the_service_hits_what_the_replay_predicts(
    requests: list[TraceRequest], policy: str, service_for: object
) -> None:
    predicted = replayed_hits(requests, policy)
    served, evictions = served_hits(requests, policy, service_for)
    assert evictions > 1000  # the cache turned over several times: order mattered
    assert sum(predicted) > 0
    assert served == predicted


def test_the_policies_differ_on_this_sequence(requests: list[TraceRequest]) -> None:
    """Otherwise the parity above would not show that the service ran the named policy."""
    by_policy = {policy: replayed_hits(requests, policy) for policy in POLICIES}
    assert by_policy["protected"] != by_policy["lru"]
    assert by_policy["adaptive"] != by_policy["lru"]  # it learned to protect here
