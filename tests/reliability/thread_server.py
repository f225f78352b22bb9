"""uvicorn serving an app in a thread of the test's own process, on 127.0.0.1: for what a
subprocess cannot take (an injected clock, a store opened with a map size no flag sets)."""

from __future__ import annotations

import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI

from tests.integration.conftest import free_port

READY_SECONDS = 20.0


class ThreadServer:
    """One app served in a thread; stopped by the test that started it."""

    def __init__(self, app: FastAPI, name: str) -> None:
        self.port = free_port()
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=name)

    @property
    def url(self) -> str:
        """Base URL of the server."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Serve, and wait until /readyz answers 200."""
        self.thread.start()
        deadline = time.monotonic() + READY_SECONDS
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/readyz", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"the in-process server did not become ready in {READY_SECONDS} s")

    def stop(self) -> None:
        """Ask uvicorn to exit (its lifespan flushes and closes the store) and wait."""
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the server thread did not stop"
