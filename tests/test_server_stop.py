"""StoppingServer: a SIGTERM stop exits with status 0 (uvicorn would re-raise the signal:
-15), and a stop that hangs is ended by the watchdog, with status 1, within its bound."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from cache_service.service.server import EXIT_STOP_OVERRAN, exit_bound_seconds
from tests.integration.conftest import free_port

GRACEFUL_SECONDS = 0.2
# A tiny ASGI app whose lifespan shutdown takes HANG seconds, served by run_single.
SCRIPT = textwrap.dedent(
    """
    import sys, time, uvicorn
    from cache_service.service.server import run_single

    HANG, GRACEFUL = float(sys.argv[2]), float(sys.argv[3])

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    time.sleep(HANG)  # blocks the loop, as a stuck stop would
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    config = uvicorn.Config(app, host="127.0.0.1", port=int(sys.argv[1]),
                            timeout_graceful_shutdown=GRACEFUL, log_level="warning")
    sys.exit(run_single(config))
    """
)


def sigterm_exit(hang_seconds: float) -> tuple[int, float]:
    """Start the script's server, SIGTERM it once it answers; its status and exit time."""
    port = free_port()
    args = [str(port), str(hang_seconds), str(GRACEFUL_SECONDS)]
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, *args])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                httpx.get(f"http://127.0.0.1:{port}/", timeout=1.0)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=30)
        return status, time.monotonic() - began
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_clean_sigterm_stop_exits_with_status_0() -> None:
    status, took = sigterm_exit(hang_seconds=0.0)
    assert status == 0
    assert took < exit_bound_seconds(GRACEFUL_SECONDS)


@pytest.mark.parametrize("hang_seconds", [3600.0])
def test_a_hung_stop_is_ended_by_the_watchdog_within_the_bound(hang_seconds: float) -> None:
    status, took = sigterm_exit(hang_seconds)
    bound = exit_bound_seconds(GRACEFUL_SECONDS)
    assert status == EXIT_STOP_OVERRAN
    assert bound - 0.5 <= took <= bound + 5.0
