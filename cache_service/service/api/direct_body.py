"""A large request body read straight into one buffer of its declared length.

uvicorn hands a body to the application in pieces: each read's bytes are copied by the HTTP
parser, appended to a growing bytearray, copied again into the message, and joined by the
reader; with a pause and resume of reading per 64 KiB. For a 29 MB store that was five copies
and about 28 ms of the event loop. Once the application has started reading a body of at least
DIRECT_MIN_BYTES (after its checks: auth, media type, size limit), the socket is read straight
into one buffer of the declared length (a buffered protocol: the kernel's copy is the only
one), and the reader is woken only at progress steps and at the end.

The protocol (protocol.py) offers a `DirectBody` in the request's scope; `read_body` calls
`begin` with what it has already received, then waits for the rest.
"""

from __future__ import annotations

from collections.abc import Callable

DIRECT_MIN_BYTES = 1 << 20  # bodies from this size are read straight into one buffer
PROGRESS_BYTES = 1 << 20  # the reader is woken after each this many bytes (its body timeout)
SCOPE_KEY = "cache_service.direct_body"


class DirectBody:
    """One request body of a declared length, filled in place once `begin` is called."""

    __slots__ = ("_buffer", "_notified", "_on_begin", "filled", "length")

    def __init__(self, length: int, on_begin: Callable[[], object]) -> None:
        self.length = length
        self.filled = 0
        self._buffer: bytearray | None = None
        self._notified = 0
        self._on_begin = on_begin  # the protocol hands the connection to a buffered reader

    @property
    def active(self) -> bool:
        """Whether reads now go into the buffer."""
        return self._buffer is not None

    @property
    def complete(self) -> bool:
        """Whether the whole body is in."""
        return self.filled == self.length

    def begin(self, received: bytes) -> None:
        """Take over from here: `received` is the body so far, later reads go to the buffer."""
        self._buffer = bytearray(self.length)
        self.take(received)
        self._notified = self.filled
        self._on_begin()

    def take(self, data: bytes | memoryview) -> int:
        """Copy as much of `data` as the body still lacks; the bytes taken."""
        assert self._buffer is not None
        count = min(len(data), self.length - self.filled)
        end = self.filled + count
        self._buffer[self.filled : end] = memoryview(data)[:count]
        self.filled = end
        return count

    def space(self) -> memoryview:
        """Where the next bytes go: the part of the buffer not yet filled."""
        assert self._buffer is not None
        return memoryview(self._buffer)[self.filled :]

    def grew(self, count: int) -> None:
        """`count` bytes were written into `space()`."""
        self.filled += count

    def progressed(self) -> bool:
        """Whether a progress step has passed since the reader was last woken (and note it)."""
        if self.filled - self._notified < PROGRESS_BYTES:
            return False
        self._notified = self.filled
        return True

    def body(self) -> bytearray:
        """The whole body."""
        assert self._buffer is not None and self.complete
        return self._buffer
