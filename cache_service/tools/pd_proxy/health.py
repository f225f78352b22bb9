"""The background health checks: every engine's GET /health, every interval, all at once.

A 200 marks an engine healthy; anything else (another status, no connection, no answer
within the connect timeout) marks it down. A request that cannot connect marks its engine
down at once too (`flow.py`); only a check brings it back.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from cache_service.tools.pd_proxy.engines import Engine, EnginePool
from cache_service.tools.pd_proxy.reporting import describe_error

log = logging.getLogger("cache_service.tools.pd_proxy")


async def check_engine(
    pool: EnginePool, client: httpx.AsyncClient, engine: Engine, *, timeout_seconds: float
) -> bool:
    """Check one engine's GET /health and mark it; whether it is healthy."""
    try:
        response = await client.get(engine.url + "/health", timeout=timeout_seconds)
    except httpx.HTTPError as exc:
        pool.mark_down(engine, f"GET /health failed: {describe_error(exc)}")
        return False
    if response.status_code != 200:
        pool.mark_down(engine, f"GET /health answered {response.status_code}")
        return False
    pool.mark_up(engine)
    return True


async def check_all(pool: EnginePool, client: httpx.AsyncClient, *, timeout_seconds: float) -> None:
    """One round of checks of every engine, concurrently."""
    await asyncio.gather(
        *(
            check_engine(pool, client, engine, timeout_seconds=timeout_seconds)
            for engine in pool.all()
        )
    )


async def watch_health(
    pool: EnginePool,
    client: httpx.AsyncClient,
    *,
    interval_seconds: float,
    timeout_seconds: float,
) -> None:
    """Check every engine every `interval_seconds`, until cancelled."""
    while True:
        await asyncio.sleep(interval_seconds)
        try:
            await check_all(pool, client, timeout_seconds=timeout_seconds)
        except Exception:  # a bug must not end the checks: engines would keep their state
            log.exception("a round of health checks failed")
