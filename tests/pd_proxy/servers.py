"""An ASGI app served by real uvicorn in a thread of the test's process, on 127.0.0.1 and a
free port; stopped by the fixture that started it."""

from __future__ import annotations

import threading
import time

import uvicorn
from starlette.types import ASGIApp

from tests.integration.conftest import free_port

START_SECONDS = 20.0


class ThreadedServer:
    """One app in one thread (its own event loop)."""

    def __init__(self, app: ASGIApp, *, name: str, log_level: str = "critical") -> None:
        self.port = free_port()
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level=log_level,
            access_log=False,
            ws="none",
            interface="asgi3",
            lifespan="on",
            timeout_graceful_shutdown=1,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=name, daemon=True)

    @property
    def url(self) -> str:
        """The server's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Serve, and wait until uvicorn says it has started (its lifespan run)."""
        self.thread.start()
        deadline = time.monotonic() + START_SECONDS
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{self.thread.name} did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        """Ask uvicorn to exit, and wait for its thread."""
        if not self.thread.is_alive():
            return
        self.server.should_exit = True
        self.thread.join(timeout=15)
        assert not self.thread.is_alive(), f"{self.thread.name} did not stop"
