"""Asking an engine's replay socket for the batches a subscriber missed.

vLLM's and SGLang's ZmqEventPublisher bind a ROUTER that reads ``[identity, b"", start]``
(start: 8 bytes big-endian) and answers, for each buffered batch with seq >= start,
``[identity, b"", seq, payload]``, then ``[identity, b"", -1 as 8 signed bytes, b""]``.
A DEALER sends the empty delimiter itself and may read any number of replies, where a REQ
(as vLLM's example subscriber uses) would refuse the second one.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

SLICE_SECONDS = 0.1  # how often a waiting replay looks at the stop flag


@dataclass(slots=True)
class ReplayResult:
    """The batches replayed, whether the end marker came, and the malformed replies."""

    batches: list[tuple[int, bytes]] = field(default_factory=list)
    complete: bool = False
    malformed: int = 0


def request_replay(
    context: zmq.Context[Any],
    endpoint: str,
    start_seq: int,
    *,
    timeout_seconds: float,
    stop: threading.Event | None = None,
) -> ReplayResult:
    """The batches from `start_seq` on, read until the end marker, the deadline or `stop`."""
    result = ReplayResult()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        deadline = time.monotonic() + timeout_seconds
        while stop is None or not stop.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if not dealer.poll(max(1, int(min(remaining, SLICE_SECONDS) * 1000))):
                continue
            frames = dealer.recv_multipart()
            if len(frames) != 3 or frames[0] != b"" or len(frames[1]) != 8:
                result.malformed += 1
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            if seq < 0:  # the end marker: seq -1, an empty payload
                result.complete = True
                break
            result.batches.append((seq, frames[2]))
    finally:
        dealer.close(linger=0)
    return result
