"""Clock jumps of 30 days, forward and back: in PrefixCache over LMDB, and in a real server.

The requirement is that no block is served past its class TTL. Time is the injected clock's,
and a wall clock may be stepped either way (NTP, a VM resumed, an operator's mistake), so:
- A block is served only while 0 <= now - (its last store or hit) < its TTL, as the clock
  reads now. Its expiry is kept as an absolute time, so a restart at the same clock keeps its
  remaining TTL, and a forward jump past the TTL makes every block a miss at once.
- A block stored while the clock ran ahead is from the future once the clock comes back: it
  must not outlive its TTL counted from that moment (served at most until now + TTL, never for
  30 days + TTL). Whether it is served at all before then is the store's choice.
- A block the sweeper removed during a forward jump stays removed after the clock comes back.
  One that expired during the jump but was not yet swept may be served again when the clock
  returns to within its TTL window: by the clock it is then younger than its TTL, and the
  alternative (judging expiry by the highest time ever seen) would make every block stored
  after the correction live 30 days too long or expire at once. The tests check the TTL bound,
  and report which of the two happened.
- Pinned blocks never expire (an operator's promise), whatever the clock does.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from cache_service.client import CacheClient
from cache_service.core.blocks import Namespace
from cache_service.core.cache import PrefixCache
from cache_service.core.config import CacheConfig
from cache_service.core.operators import Operators
from cache_service.core.retention import DEFAULT_LIFETIMES
from cache_service.core.store.lmdb.store import LmdbStore
from cache_service.core.store.protocols import BlockStore
from cache_service.service.api.app import create_app
from cache_service.service.settings import Settings
from tests.reliability.model_chains import JumpClock
from tests.reliability.thread_server import ThreadServer

DAY = 86400.0
JUMP = 30 * DAY
TTLS = {"agent": 3 * DAY, "chat": 7 * DAY}  # the shipped retention classes
START = 1_700_000_000.0
BLOCK = 2
NS = Namespace(model="m")
MODEL = "m"


def prompt(number: int, blocks: int = 2) -> list[int]:
    """A prompt of `blocks` full blocks that shares no block with another number's."""
    return [number * 1000 + i for i in range(blocks * BLOCK)]


def open_cache(folder: Path, clock: JumpClock) -> PrefixCache:
    """A cache with the shipped classes over an LMDB folder (touches applied at once)."""
    store = LmdbStore(folder, map_size_bytes=1 << 26, lifetimes=DEFAULT_LIFETIMES)
    return PrefixCache(store, config=CacheConfig(default_block_size=BLOCK), clock=clock)


def served(cache: PrefixCache, tokens: list[int]) -> int:
    """Blocks a lookup serves, without marking them used (a probe must not slide a TTL)."""
    found = cache.match_prefix(NS, tokens, with_payloads=True, touch=False)
    keys = cache.chain(NS, tokens).keys
    fetched = sum(payload is not None for payload in cache.get_payloads(NS, keys))
    assert fetched == found.matched_blocks, "fetch by key and lookup disagree"
    return found.matched_blocks


def expiries(cache: PrefixCache, raw_of: Callable[[BlockStore], Any]) -> dict[bytes, float]:
    """Every stored block's absolute expiry, read from the LMDB records (`raw_of`: the
    raw access fixture of tests/conftest.py)."""
    return {bytes(key): meta.expires_at for key, meta in raw_of(cache.store).blocks().items()}


# -- PrefixCache over LMDB ---------------------------------------------------------------------


def test_forward_jump_past_every_ttl_misses_every_block_and_the_sweeper_removes_them(
    tmp_path: Path, report: Callable[..., None]
) -> None:
    clock = JumpClock(START)
    cache = open_cache(tmp_path / "lmdb", clock)
    try:
        cache.insert(NS, prompt(1), [b"a1", b"a2"], retention="agent")
        cache.insert(NS, prompt(2), [b"c1", b"c2"], retention="chat")
        cache.insert(NS, prompt(3), [b"p1", b"p2"], retention="agent")
        Operators.for_cache(cache).pin(NS, prompt(3), by="operator")
        assert [served(cache, prompt(n)) for n in (1, 2, 3)] == [2, 2, 2]

        clock.advance(JUMP)
        assert [served(cache, prompt(n)) for n in (1, 2)] == [0, 0]
        assert served(cache, prompt(3)) == 2, "a pinned block never expires"
        swept = cache.capacity.sweep_expired()
        assert swept == 4
        assert cache.capacity.usage().blocks == 2

        clock.advance(-JUMP)  # the clock comes back: what was swept stays gone
        assert [served(cache, prompt(n)) for n in (1, 2, 3)] == [0, 0, 2]
    finally:
        cache.store.close()
    report(jump_days=30, swept=swept, after_jump_back="swept blocks stay gone, pin kept")


def test_a_block_expired_by_a_forward_jump_is_never_served_past_its_ttl_after_the_jump_back(
    tmp_path: Path, report: Callable[..., None]
) -> None:
    clock = JumpClock(START)
    cache = open_cache(tmp_path / "lmdb", clock)
    try:
        cache.insert(NS, prompt(1), [b"a1", b"a2"], retention="agent")
        clock.advance(JUMP)
        assert served(cache, prompt(1)) == 0
        clock.advance(-JUMP + 3600)  # back to an hour after it was stored, not swept
        resurrected = served(cache, prompt(1))
        assert resurrected in (0, 2)  # within its TTL by the clock: either is allowed
        clock.advance(TTLS["agent"] - 3600)  # exactly its TTL after it was stored
        assert served(cache, prompt(1)) == 0
        assert cache.capacity.sweep_expired() == 2
    finally:
        cache.store.close()
    report(unswept_block_after_jump_back="served" if resurrected else "a miss")


def store_ahead_and_come_back(cache: PrefixCache, clock: JumpClock, jump_seconds: float) -> None:
    """With the clock `jump_seconds` ahead, store prompt 1 as agent and 2 as chat; then the
    clock comes back, and the sweeper runs once (a server's runs every --sweep-interval)."""
    clock.advance(jump_seconds)
    cache.insert(NS, prompt(1), [b"a1", b"a2"], retention="agent")
    cache.insert(NS, prompt(2), [b"c1", b"c2"], retention="chat")
    clock.advance(-jump_seconds)
    cache.capacity.sweep_expired()


# 30 days is past every TTL; 5 days is past agent's but within chat's, so a bound by the
# longest TTL alone, or a rule that only refuses blocks from the future, would still serve
# a block past its TTL counted from when the clock came back.
@pytest.mark.parametrize("jump_days", [30, 5])
def test_a_block_stored_while_the_clock_ran_ahead_is_not_served_past_its_ttl_once_it_is_back(
    tmp_path: Path,
    jump_days: int,
    raw_of: Callable[[BlockStore], Any],
    report: Callable[..., None],
) -> None:
    clock = JumpClock(START)
    cache = open_cache(tmp_path / "lmdb", clock)
    try:
        store_ahead_and_come_back(cache, clock, jump_days * DAY)
        remaining = sorted(
            round((at - clock()) / DAY, 3) for at in expiries(cache, raw_of).values()
        )
        served_after_jump_back = [served(cache, prompt(n)) for n in (1, 2)]
        clock.advance(TTLS["agent"])
        assert served(cache, prompt(1)) == 0, (
            f"an agent block stored {jump_days} days ahead is served 3 days after the clock "
            f"came back (remaining TTLs when it came back: {remaining} days)"
        )
        clock.advance(TTLS["chat"] - TTLS["agent"])
        assert served(cache, prompt(2)) == 0, "a chat block served 7 days after the clock came back"
        cache.capacity.sweep_expired()
        clock.advance(jump_days * DAY)  # the clock reaches the time they were stored at again
        assert [served(cache, prompt(n)) for n in (1, 2)] == [0, 0], "served once time caught up"
    finally:
        cache.store.close()
    report(
        jump_days=jump_days,
        remaining_days_after_jump_back=remaining,
        served_right_after_jump_back=served_after_jump_back,
    )


def test_the_sweeper_removes_a_block_stored_while_the_clock_ran_ahead_once_past_its_ttl(
    tmp_path: Path, report: Callable[..., None]
) -> None:
    clock = JumpClock(START)
    cache = open_cache(tmp_path / "lmdb", clock)
    try:
        store_ahead_and_come_back(cache, clock, JUMP)
        clock.advance(TTLS["chat"])
        swept = cache.capacity.sweep_expired()
        left = cache.capacity.usage().blocks
        assert left == 0, "every block is past its TTL counted from when the clock came back"
    finally:
        cache.store.close()
    report(swept_7_days_after_jump_back=swept, left=left)


@pytest.mark.parametrize("how", ["clean", "crash"])
def test_a_restart_keeps_each_blocks_remaining_ttl(
    tmp_path: Path, how: str, raw_of: Callable[[BlockStore], Any], report: Callable[..., None]
) -> None:
    clock = JumpClock(START)
    folder = tmp_path / "lmdb"
    cache = open_cache(folder, clock)
    abandoned = None
    try:
        for number, retention in ((1, "agent"), (2, "chat")):
            cache.insert(NS, prompt(number), [b"x1", b"x2"], retention=retention)
        clock.advance(DAY)
        before = expiries(cache, raw_of)
        if how == "clean":
            cache.store.close()
        else:  # abandoned open; a new environment opens the crash image (see test_model.py)
            abandoned, folder = cache, tmp_path / "image"
            shutil.copytree(tmp_path / "lmdb", folder)
        cache = open_cache(folder, clock)
        assert expiries(cache, raw_of) == before, "expiry is an absolute time, kept as it was"
        remaining = sorted(round((at - clock()) / DAY, 6) for at in before.values())
        assert remaining == [2.0, 2.0, 6.0, 6.0]  # agent: 3 days - 1, chat: 7 days - 1

        clock.advance(2 * DAY - 1)
        assert [served(cache, prompt(n)) for n in (1, 2)] == [2, 2]
        clock.advance(1)
        assert [served(cache, prompt(n)) for n in (1, 2)] == [0, 2]
        clock.advance(4 * DAY - 1)
        assert served(cache, prompt(2)) == 2
        clock.advance(1)
        assert served(cache, prompt(2)) == 0
    finally:
        cache.store.close()
        if abandoned is not None:
            abandoned.store.close()
    report(restart=how, remaining_days_after_restart=remaining)


# -- a real server with an injected clock ---------------------------------------------------------


def clock_server(data_dir: Path, clock: JumpClock) -> ThreadServer:
    """A real server on `data_dir` whose clock is `clock` (in this process: a subprocess
    cannot take an injected clock)."""
    settings = Settings(
        data_dir=data_dir, block_size=BLOCK, sweep_interval=0.05, touch_flush_interval=0.05
    )
    return ThreadServer(create_app(settings, clock=clock), "clock-test-server")


@contextmanager
def serving(data_dir: Path, clock: JumpClock) -> Iterator[CacheClient]:
    """A started server and a client of it; the server is stopped on the way out."""
    server = clock_server(data_dir, clock)
    server.start()
    client = CacheClient(server.url)
    try:
        yield client
    finally:
        client.close()
        server.stop()


def hits(client: CacheClient, tokens: list[int]) -> int:
    """Blocks the server serves for a prompt (with their payloads, and by key)."""
    found = client.lookup(MODEL, tokens, fetch=True)
    assert found.payloads is not None
    assert len(found.payloads) == found.matched_blocks
    return found.matched_blocks


def wait_for(condition: Callable[[], bool], what: str, seconds: float = 15.0) -> float:
    """Poll until `condition` holds; how long it took."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > seconds:
            raise AssertionError(f"{what}: not within {seconds} s")
        time.sleep(0.02)
    return time.monotonic() - started


def test_server_forward_jump_misses_and_sweeps_every_block_and_the_jump_back_resurrects_none(
    tmp_path: Path, report: Callable[..., None]
) -> None:
    clock = JumpClock(START)
    with serving(tmp_path / "data", clock) as client:
        client.store(MODEL, prompt(1), [b"a1", b"a2"], retention="agent")
        client.store(MODEL, prompt(2), [b"c1", b"c2"], retention="chat")
        assert [hits(client, prompt(n)) for n in (1, 2)] == [2, 2]
        clock.advance(JUMP)
        assert [hits(client, prompt(n)) for n in (1, 2)] == [0, 0]
        swept_in = wait_for(lambda: client.stats()["blocks"] == 0, "the sweeper empties the store")
        clock.advance(-JUMP)
        assert [hits(client, prompt(n)) for n in (1, 2)] == [0, 0]
    report(jump_days=30, swept_within_seconds=f"{swept_in:.2f}")


def test_server_never_serves_a_block_stored_while_the_clock_ran_ahead_past_its_ttl(
    tmp_path: Path, report: Callable[..., None]
) -> None:
    clock = JumpClock(START)
    with serving(tmp_path / "data", clock) as client:
        clock.advance(JUMP)
        client.store(MODEL, prompt(1), [b"a1", b"a2"], retention="agent")
        clock.advance(-JUMP)
        time.sleep(0.5)  # ten sweeper runs at the clock's own time
        clock.advance(TTLS["agent"])
        served_then = hits(client, prompt(1))
        assert served_then == 0, (
            "an agent block stored while the clock was 30 days ahead is served 3 days after "
            "the clock came back"
        )
        clock.advance(JUMP)
        served_later = hits(client, prompt(1))
        assert served_later == 0, "served again once the clock reached its time of storing"
    report(served_3_days_after_jump_back=served_then, served_when_time_caught_up=served_later)


def test_server_restart_keeps_each_blocks_remaining_ttl(
    tmp_path: Path, report: Callable[..., None]
) -> None:
    # A hit slides a TTL, so each boundary is probed with its own prompt, looked up once.
    clock = JumpClock(START)
    stored = {1: "agent", 2: "agent", 3: "chat", 4: "chat"}
    with serving(tmp_path / "data", clock) as client:
        for number, retention in stored.items():
            client.store(MODEL, prompt(number), [b"x1", b"x2"], retention=retention)
    clock.advance(DAY)
    with serving(tmp_path / "data", clock) as client:
        clock.advance(2 * DAY - 1)
        agent_before = hits(client, prompt(1))
        clock.advance(1)
        agent_at = hits(client, prompt(2))
        clock.advance(4 * DAY - 1)
        chat_before = hits(client, prompt(3))
        clock.advance(1)
        chat_at = hits(client, prompt(4))
    assert (agent_before, agent_at, chat_before, chat_at) == (2, 0, 2, 0)
    report(restart_after_days=1, agent_expires_after_days=3, chat_expires_after_days=7)


def test_a_lowered_ttl_leaves_lookup_and_fetch_agreeing(tmp_path: Path) -> None:
    """A class's TTL lowered between runs (allowed: retention may change): stored blocks keep
    the expiry they were given, and every path says so alike. A lookup once reported blocks
    that no fetch could deliver, and a continuation of them was refused (409)."""
    from cache_service.core.retention import RetentionPolicy  # noqa: PLC0415

    clock = JumpClock(START)
    folder = tmp_path / "lmdb"
    cache = open_cache(folder, clock)
    cache.insert(NS, prompt(1, blocks=4), [b"a", b"b", b"c", b"d"], retention="chat")
    cache.store.close()
    shorter = RetentionPolicy({"agent": 3 * DAY, "chat": 3600.0}, default_class="chat")
    store = LmdbStore(folder, map_size_bytes=1 << 26, lifetimes=shorter.lifetimes())
    cache = PrefixCache(
        store, config=CacheConfig(default_block_size=BLOCK, retention=shorter), clock=clock
    )
    try:
        clock.advance(2 * 3600.0)  # past the new TTL, within the one the blocks were given
        assert cache.match_prefix(NS, prompt(1, blocks=4), touch=False).matched_blocks == 4
        assert served(cache, prompt(1, blocks=4)) == 4  # lookup with fetch, fetch by key
        cache.insert(NS, prompt(1, blocks=5), [b"e"], retention="chat", start_block=4)
        assert served(cache, prompt(1, blocks=5)) == 5
    finally:
        cache.store.close()
