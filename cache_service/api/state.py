"""What the routes share: the cache, metrics and settings of one running service."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from cache_service.cache import PrefixCache
from cache_service.errors import StorageError
from cache_service.metrics import CacheMetrics
from cache_service.settings import Settings


@dataclass
class ServiceState:
    """The resources the lifespan opened."""

    cache: PrefixCache
    metrics: CacheMetrics
    settings: Settings
    store_kind: str


class NotReady(StorageError):
    """The service is starting or stopping; its store is not open."""

    status = 503
    problem = "not-ready"
    title = "Service not ready"


def service_state(request: Request) -> ServiceState:
    """The running service's state; 503 while the store is not open."""
    state: ServiceState | None = getattr(request.app.state, "service", None)
    if state is None:
        raise NotReady("the store is not open yet")
    return state
