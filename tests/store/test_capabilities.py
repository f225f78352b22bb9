"""Each backend's declared capabilities: its facets agree with them, the registry tells them
before opening, and a control the declaration lacks answers 501 without touching the store."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from conftest import memory_store_for

from cache_service.core.store import registry
from cache_service.core.store.lmdb.store import LmdbStore
from cache_service.core.store.memory import MemoryStore
from cache_service.core.store.protocols import BEHAVIOURS, BlockStore, Capabilities
from cache_service.core.store.redis.store import RedisStore
from cache_service.service.api.app import create_app
from cache_service.service.settings import Settings


def test_a_store_has_a_disk_and_a_remote_facet_exactly_when_it_declares_them(
    store: BlockStore,
) -> None:
    declared = store.capabilities
    assert declared.has("disk") == (store.disk is not None)
    assert declared.has("remote") == (store.remote is not None)
    if store.disk is not None:
        assert store.disk.folder.is_dir()
        assert store.disk.file_bytes() > 0
    if store.remote is not None:
        counts = store.remote.health_counts()
        assert counts and all(isinstance(count, int) for count in counts.values())
        assert store.remote.memory_limit_bytes() >= 0


def test_every_lacking_is_a_known_behaviour_with_its_reason() -> None:
    for declared in (MemoryStore.capabilities, LmdbStore.capabilities, RedisStore.capabilities):
        assert set(declared.lacks) <= set(BEHAVIOURS)
        assert all(reason.strip() for reason in declared.lacks.values())
        assert declared.offered() == [name for name in BEHAVIOURS if declared.has(name)]
    with pytest.raises(ValueError, match="unknown behaviours \\['teleport'\\]"):
        Capabilities("x", lacks={"teleport": "no"})
    with pytest.raises(ValueError, match="'teleport' is not one of"):
        MemoryStore.capabilities.has("teleport")


def test_the_registry_tells_a_urls_capabilities_before_opening() -> None:
    assert registry.capabilities_of("/var/lib/cache") is LmdbStore.capabilities
    assert registry.capabilities_of("lmdb://cache-data") is LmdbStore.capabilities
    assert registry.capabilities_of("memory://") is MemoryStore.capabilities
    assert registry.capabilities_of("rediss://a:1,b:2") is RedisStore.capabilities
    assert not registry.capabilities_of("redis://a:1").has("store_eviction")


class _PinlessStore(MemoryStore):
    """A backend that declares it keeps no pins and purges no prefix (the 501 path)."""

    capabilities = Capabilities(
        "pinless",
        lacks={
            **MemoryStore.capabilities.lacks,
            "pins": "this test's backend keeps no pins",
            "purge_under": "this test's backend purges no prefix",
        },
    )


def test_a_control_the_store_declares_it_lacks_answers_501_naming_why() -> None:
    settings = Settings(store="memory://")
    app = create_app(settings, store=memory_store_for(settings, _PinlessStore))
    body = {"model": "m", "tokens": list(range(32)), "block_size": 16}
    calls = [
        ("POST", "/v1/pin", body),
        ("POST", "/v1/unpin", body),
        ("GET", "/v1/pins", None),
        ("POST", "/v1/purge", body),
        ("POST", "/v1/purge", {"model": "m"}),  # a whole namespace's: no pin, no prefix
    ]

    async def answers() -> list[httpx.Response]:
        # The app in this process with its lifespan (the store) running; no server needed.
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://service") as client,
        ):
            return [await client.request(method, path, json=sent) for method, path, sent in calls]

    *refused, whole = asyncio.run(answers())
    for answer in refused:
        assert answer.status_code == 501, answer.text
        assert answer.headers["content-type"] == "application/problem+json"
        problem = answer.json()
        assert problem["type"].endswith("not-supported-by-store")
        assert "pinless store: this test's backend" in problem["detail"]
    assert whole.status_code == 200, whole.text
