"""Fixtures of the KV-event tests: a ZMQ context and an empty set of engine views."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from cache_service.core.engines.views import EngineViews


@pytest.fixture
def context() -> Iterator[zmq.Context[Any]]:
    """A ZMQ context for a test's publishers, destroyed after it."""
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def views() -> EngineViews:
    """Engine views with room for 10,000 entries per engine."""
    return EngineViews(max_blocks_per_engine=10_000)
