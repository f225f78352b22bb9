"""Token counts from D's answers: the `usage` of a JSON answer, or of a stream's final chunk
(sent when the request asked `stream_options.include_usage`).

A stream is scanned cheaply: only lines that mention "usage" are parsed, and only when the
request asked for usage. Bytes pass through unchanged whatever is found.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

MAX_PENDING_BYTES = 1 << 20  # a line longer than this is no usage chunk: dropped unread
USAGE_MARK = b'"usage"'


class StreamUsage:
    """The last `usage` object among a stream's `data: {...}` lines, fed chunk by chunk."""

    def __init__(self) -> None:
        self.usage: dict[str, Any] | None = None
        self._pending = b""

    def feed(self, chunk: bytes) -> None:
        """Read the complete lines of `chunk` (a line cut between chunks waits for the rest)."""
        if b"\n" not in chunk:
            self._pending += chunk
            if len(self._pending) > MAX_PENDING_BYTES:
                self._pending = b""
            return
        lines = (self._pending + chunk).split(b"\n")
        self._pending = lines.pop()
        for line in lines:
            self._read(line)

    def finish(self) -> dict[str, Any] | None:
        """Read what is left (a last line without a newline); the usage found, if any."""
        self._read(self._pending)
        self._pending = b""
        return self.usage

    def _read(self, line: bytes) -> None:
        if USAGE_MARK not in line:
            return
        line = line.strip()
        if not line.startswith(b"data:"):
            return
        usage = _usage_of(line[5:].strip())
        if usage is not None:
            self.usage = usage


def answer_usage(body: bytes) -> dict[str, Any] | None:
    """The `usage` object of a JSON answer; None if it has none (or is not JSON)."""
    if USAGE_MARK not in body:
        return None
    return _usage_of(body.strip())


def asks_for_usage(request: Mapping[str, Any]) -> bool:
    """Whether a streamed request asked for a final usage chunk."""
    options = request.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _usage_of(payload: bytes) -> dict[str, Any] | None:
    if not payload.startswith(b"{"):
        return None
    try:
        answer = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    usage = answer.get("usage") if isinstance(answer, dict) else None
    return usage if isinstance(usage, dict) else None
