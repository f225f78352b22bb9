"""Asking an engine's replay socket for the batches a subscriber missed.

vLLM's and SGLang's ZmqEventPublisher bind a ROUTER that reads ``[identity, b"", start]``
(start: 8 bytes big-endian) and answers, for each buffered batch with seq >= start, one
reply, then an end marker of seq -1 (8 signed bytes). What a DEALER reads differs by
release (each checked in the engine's `_service_replay`):

    vLLM 0.32 (topic added)    [b"", topic, seq, payload]   end [b"", b"", -1, b""]
    SGLang, older vLLM         [b"", seq, payload]          end [b"", -1, b""]

Both are taken, told apart by their frame count, so a mixed fleet replays. A DEALER sends
the empty delimiter itself and may read any number of replies, where a REQ (as vLLM's
example subscriber uses) would refuse the second one.
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
            reply = parse_reply(dealer.recv_multipart())
            if reply is None:
                result.malformed += 1
                continue
            seq, payload = reply
            if seq < 0:  # the end marker: seq -1, an empty payload
                result.complete = True
                break
            result.batches.append((seq, payload))
    finally:
        dealer.close(linger=0)
    return result


def parse_reply(frames: list[bytes]) -> tuple[int, bytes] | None:
    """(seq, payload) of one replay reply in either release's layout; None if malformed."""
    if len(frames) not in (3, 4) or frames[0] != b"":
        return None
    seq_frame, payload = frames[-2], frames[-1]  # a topic, when sent, stands before them
    if len(seq_frame) != 8:
        return None
    return int.from_bytes(seq_frame, "big", signed=True), payload
