"""What a fail-open client counts and logs, so that a wrong URL does not pass for a 0% hit rate.

Every call answered with a fail-open miss is counted by reason:

    connect         the service could not be connected to (refused, unknown host, no route)
    timeout         connecting, sending or reading took longer than the client's timeout
    transport       the connection broke mid-exchange (reset, malformed answer head)
    status          the service, or a proxy in front of it, answered 5xx
    invalid_answer  a 2xx answer the client cannot parse (another service at that URL?)
    store_full      507: a store was not kept (the service is up: no backoff)
    backoff         skipped without the network while backing off after a failure

The counts are read from `client.failures` (a `FailOpenCounts`), and, for a client given a
Prometheus registry, exported as `prompt_cache_client_fail_open_total{reason}`. Failures are
also logged as warnings on the `cache_service.client` logger, at most one line per URL every
`LOG_INTERVAL_SECONDS`, each naming the URL, the error and how many misses went unlogged.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Counter

LOGGER = logging.getLogger("cache_service.client")
LOG_INTERVAL_SECONDS = 30.0
METRIC_NAME = "prompt_cache_client_fail_open"  # exposed with the counter's `_total` suffix


@dataclass(frozen=True, slots=True)
class FailOpenCounts:
    """Calls a client answered with a fail-open miss, by reason, since it was created."""

    connect: int = 0
    timeout: int = 0
    transport: int = 0
    status: int = 0
    invalid_answer: int = 0
    store_full: int = 0
    backoff: int = 0

    @property
    def total(self) -> int:
        """Every fail-open miss, whatever its reason."""
        return sum(getattr(self, name) for name in FAIL_OPEN_REASONS)


FAIL_OPEN_REASONS = tuple(field.name for field in fields(FailOpenCounts))


def transport_reason(exc: httpx.HTTPError) -> str:
    """The reason a transport error is counted under: connect, timeout or transport."""
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, httpx.ConnectError):
        return "connect"
    return "transport"


class FailOpenTally:
    """One client's fail-open counts, and their Prometheus counter if given a registry."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self._counts = dict.fromkeys(FAIL_OPEN_REASONS, 0)
        self._lock = threading.Lock()  # a blocking client may be shared by threads
        self._counter = None if registry is None else _registry_counter(registry)

    def add(self, reason: str) -> None:
        """Count one fail-open miss."""
        with self._lock:
            self._counts[reason] += 1
        if self._counter is not None:
            self._counter.labels(reason).inc()

    def snapshot(self) -> FailOpenCounts:
        """The counts so far."""
        with self._lock:
            return FailOpenCounts(**self._counts)


# One counter per registry: several clients (a worker's sync and async twins, or a client
# re-created after a configuration change) share it instead of failing on a duplicate name.
_COUNTERS: weakref.WeakKeyDictionary[CollectorRegistry, Counter] = weakref.WeakKeyDictionary()
_COUNTERS_LOCK = threading.Lock()


def _registry_counter(registry: CollectorRegistry) -> Counter:
    from prometheus_client import Counter  # noqa: PLC0415 - only clients given a registry need it

    with _COUNTERS_LOCK:
        counter = _COUNTERS.get(registry)
        if counter is None:
            counter = Counter(
                METRIC_NAME,
                "Prompt cache client calls answered with a fail-open miss, by reason.",
                ["reason"],
                registry=registry,
            )
            for reason in FAIL_OPEN_REASONS:  # every reason exported from the start, at 0
                counter.labels(reason)
            _COUNTERS[registry] = counter
        return counter


@dataclass(slots=True)
class _UrlLog:
    logged_at: float | None = None
    unlogged: int = 0  # fail-open misses since the last line


class FailureLog:
    """Warnings about fail-open misses, at most one line per URL per interval.

    Keyed by URL across clients, so that a worker opening a client per request is limited too.
    """

    def __init__(self, interval_seconds: float = LOG_INTERVAL_SECONDS) -> None:
        self._interval_seconds = interval_seconds
        self._by_url: dict[str, _UrlLog] = {}
        self._lock = threading.Lock()

    def note(self, url: str, now: float, error: str | None) -> None:
        """Log `error` for `url` unless a line went out within the interval, else count it."""
        # An error of None is a miss that skipped the network while backing off: only counted.
        with self._lock:
            state = self._by_url.setdefault(url, _UrlLog())
            first = state.logged_at is None
            since = 0.0 if state.logged_at is None else now - state.logged_at
            # A negative span is another client's clock (tests inject them): not a recent line.
            if error is None or (not first and 0 <= since < self._interval_seconds):
                state.unlogged += 1
                return
            unlogged, state.unlogged, state.logged_at = state.unlogged, 0, now
        if first:
            LOGGER.warning("prompt cache %s failing open, calls answer misses: %s", url, error)
        else:
            LOGGER.warning(
                "prompt cache %s failing open, calls answer misses: %s "
                "(%d more fail-open misses since the last line)",
                url,
                error,
                unlogged,
            )


FAILURE_LOG = FailureLog()
