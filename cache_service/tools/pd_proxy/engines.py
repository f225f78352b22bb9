"""The engine pool: each engine's health and requests in flight, and the choice of one.

An engine is chosen among the healthy ones of its role: the one holding the longest prefix of
the prompt (when the cache said), then the one with fewest requests in flight, then in turn.
Choosing and counting the request in flight happen without an `await` between them, so two
requests arriving together see each other's count.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from cache_service.tools.pd_proxy.metrics import ProxyMetrics
from cache_service.tools.pd_proxy.options import ROLES, ProxyOptions, Role

log = logging.getLogger("cache_service.tools.pd_proxy")
NOT_CHECKED = "not checked yet"


@dataclass(slots=True, eq=False)
class Engine:
    """One engine of one role, as the proxy sees it now."""

    name: str
    url: str
    role: Role
    healthy: bool = False
    in_flight: int = 0
    last_error: str | None = NOT_CHECKED

    def describe(self) -> str:
        """`name (url)`, for messages."""
        return f"{self.name} ({self.url})"


class EnginePool:
    """Every configured engine by role; health and in-flight counts kept in the metrics too."""

    def __init__(self, options: ProxyOptions, metrics: ProxyMetrics) -> None:
        self._metrics = metrics
        self._by_role: dict[Role, tuple[Engine, ...]] = {
            role: tuple(Engine(a.name, a.url, role) for a in options.engines(role))
            for role in ROLES
        }
        self._turn: dict[Role, int] = dict.fromkeys(ROLES, 0)
        for engine in self.all():
            metrics.add_engine(engine.name, engine.role)

    def all(self) -> tuple[Engine, ...]:
        """Every engine, prefill first."""
        return self._by_role["prefill"] + self._by_role["decode"]

    def engines(self, role: Role) -> tuple[Engine, ...]:
        """The engines of one role, in the order configured."""
        return self._by_role[role]

    def healthy(self, role: Role) -> list[Engine]:
        """The healthy engines of one role."""
        return [engine for engine in self._by_role[role] if engine.healthy]

    def choose(
        self,
        role: Role,
        *,
        held_tokens: Mapping[str, int] | None = None,
        exclude: Collection[Engine] = (),
    ) -> Engine | None:
        """The healthy engine of `role` holding the most tokens of the prompt, then with the
        fewest requests in flight, then the next in turn; None when none is healthy."""
        held = held_tokens or {}
        candidates = [engine for engine in self.healthy(role) if engine not in exclude]
        if not candidates:
            return None
        best = max((held.get(e.name, 0), -e.in_flight) for e in candidates)
        ties = [e for e in candidates if (held.get(e.name, 0), -e.in_flight) == best]
        turn = self._turn[role]
        self._turn[role] = turn + 1
        return ties[turn % len(ties)]

    def begin(self, engine: Engine) -> None:
        """Count one more request in flight on `engine` (`end` counts it done)."""
        engine.in_flight += 1
        self._metrics.engine_in_flight.labels(engine.name, engine.role).set(engine.in_flight)

    def end(self, engine: Engine) -> None:
        """Count one request in flight on `engine` done."""
        engine.in_flight -= 1
        self._metrics.engine_in_flight.labels(engine.name, engine.role).set(engine.in_flight)

    @contextmanager
    def busy(self, engine: Engine) -> Iterator[Engine]:
        """Count one request in flight on `engine` while the block runs."""
        self.begin(engine)
        try:
            yield engine
        finally:
            self.end(engine)

    def mark_up(self, engine: Engine) -> None:
        """The engine answered: chosen again from now on."""
        if not engine.healthy:
            log.info("%s engine %s is healthy", engine.role, engine.describe())
        engine.healthy, engine.last_error = True, None
        self._metrics.engine_up.labels(engine.name, engine.role).set(1)

    def mark_down(self, engine: Engine, reason: str) -> None:
        """The engine failed: not chosen until a health check succeeds."""
        if engine.healthy or engine.last_error == NOT_CHECKED:
            log.warning("%s engine %s is down: %s", engine.role, engine.describe(), reason)
        engine.healthy, engine.last_error = False, reason
        self._metrics.engine_up.labels(engine.name, engine.role).set(0)

    def states(self, role: Role) -> dict[str, str]:
        """Each engine of `role` by name: "healthy" or why it is not."""
        return {
            engine.name: "healthy" if engine.healthy else f"down: {engine.last_error}"
            for engine in self._by_role[role]
        }
