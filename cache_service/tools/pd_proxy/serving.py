"""The proxy served by uvicorn in this process until a signal; a clean stop exits with 0."""

from __future__ import annotations

import contextlib
import copy
import logging
import logging.config
from collections.abc import Iterator
from typing import Any

import uvicorn
from uvicorn.config import LOG_LEVELS, LOGGING_CONFIG, STARTUP_FAILURE

from cache_service.tools.pd_proxy.app import create_app
from cache_service.tools.pd_proxy.options import ProxyOptions

LOGGER = "cache_service.tools.pd_proxy"
GRACEFUL_SHUTDOWN_SECONDS = 10  # open streams get this long after a signal


class CleanExitServer(uvicorn.Server):
    """uvicorn's server, without its raising the stopping signal again once stopped (so a
    SIGTERM ends with status 0), as the service's StoppingServer (which the tools layer may
    not import) does."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's signal handling, without raising the signal again after a clean stop."""
        with super().capture_signals():
            yield
            self._captured_signals.clear()


def serve(options: ProxyOptions) -> int:
    """Serve the proxy on options.host:options.port until a signal; the exit status."""
    logging_config = log_config(options.log_level)
    logging.config.dictConfig(logging_config)
    by = "requests in flight"
    if options.cache_url:
        by = f"the prefix each holds ({options.cache_url}/v1/route), then {by}"
    logging.getLogger(LOGGER).info(
        "pd-proxy on http://%s:%d: prefill %s; decode %s; engines chosen by %s",
        options.host,
        options.port,
        ", ".join(f"{e.name}={e.url}" for e in options.prefill),
        ", ".join(f"{e.name}={e.url}" for e in options.decode),
        by,
    )
    config = uvicorn.Config(
        create_app(options),
        host=options.host,
        port=options.port,
        log_level=options.log_level,
        log_config=logging_config,
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
    )
    server = CleanExitServer(config)
    server.run()
    return 0 if server.started else STARTUP_FAILURE


def log_config(level: str) -> dict[str, Any]:
    """uvicorn's logging, with the proxy's own lines through its handler."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"][LOGGER] = {
        "handlers": ["default"],
        "level": LOG_LEVELS.get(level, logging.INFO),
        "propagate": False,
    }
    return config
