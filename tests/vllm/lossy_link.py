"""A ZMQ link between a real engine's KV-event publisher and the service that can lose
batches on purpose: SUB from the engine, PUB to the service, frames passed through as they
are. A real engine never drops a batch on 127.0.0.1, so this is how a test makes the gap
the service must fill from the engine's own replay socket (which it reaches directly)."""

from __future__ import annotations

import threading
from typing import Any

import zmq


class LossyLink:
    """Forwards every message, except the next `lose(n)` ones."""

    def __init__(self, context: zmq.Context[Any], engine_endpoint: str) -> None:
        self._sub = context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(engine_endpoint)
        self._pub = context.socket(zmq.XPUB)  # a PUB that tells when a subscriber came
        self._pub.setsockopt(zmq.LINGER, 0)
        port = self._pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._to_lose = 0
        self.forwarded = self.lost = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lossy-link", daemon=True)
        self._thread.start()

    def lose(self, count: int) -> None:
        """Drop the next `count` messages."""
        with self._lock:
            self._to_lose += count

    def close(self) -> None:
        """Stop forwarding and close both sockets."""
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._pub, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(50))
                if self._pub in ready:
                    self._pub.recv()  # a subscription: nothing to do with it
                if self._sub in ready:
                    frames = self._sub.recv_multipart()
                    with self._lock:
                        dropping = self._to_lose > 0
                        self._to_lose -= dropping
                    if dropping:
                        self.lost += 1
                    else:
                        self.forwarded += 1
                        self._pub.send_multipart(frames)
        finally:
            self._sub.close(linger=0)
            self._pub.close(linger=0)
