"""The network floor: loopback TCP bulk transfer between two Python processes.

A server process (this interpreter, started by the bench, stopped by PID) holds a buffer of
the 32k prefix's size (29,163,520 bytes) and answers "F<size>" by `sendall` of that many
bytes, and "S<size>" by receiving that many bytes into a preallocated buffer and answering one
byte. The client sends one request at a time and receives with `recv_into` into a
preallocated `bytearray`, so neither side allocates or copies per transfer: what is left is
the kernel's loopback path and two processes' system calls -- the most any HTTP server and
client in Python could move here. Both sockets use TCP_NODELAY and the kernel's default
buffer sizes.
"""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import time
from functools import partial

from bench.peers.harness import (
    SINGLE_BLOCK_REPETITION_FACTOR,
    payload_rows,
    stop_process,
    time_calls,
)
from bench.peers.payloads import (
    BLOCK_TOKENS,
    BYTES_PER_TOKEN,
    PREFIX_TOKENS,
    SINGLE_BLOCK_BYTES,
    prefix_case,
    single_case,
)
from bench.report import Row

SUBJECT = "loopback tcp"
CLIENT = "python sockets, recv_into"
HEADER = struct.Struct("<cQ")  # operation (b"F" fetch, b"S" store), size in bytes
PREFIX_BYTES = (PREFIX_TOKENS // BLOCK_TOKENS) * BLOCK_TOKENS * BYTES_PER_TOKEN

SERVER = """
import socket, struct, sys
header = struct.Struct("<cQ")
size = int(sys.argv[1])
listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
listener.bind(("127.0.0.1", 0))
listener.listen(1)
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
outbox = memoryview(bytes(size))
inbox = memoryview(bytearray(size))

def receive(view):
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True

request = memoryview(bytearray(header.size))
while receive(request):
    operation, length = header.unpack(request)
    if operation == b"F":
        conn.sendall(outbox[:length])
    elif receive(inbox[:length]):
        conn.sendall(b"k")
"""


def _receive_into(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        count = conn.recv_into(view[got:])
        if count == 0:
            raise ConnectionError("loopback server closed the connection")
        got += count


def _connect(port: int, *, timeout_seconds: float) -> socket.socket:
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            conn = socket.create_connection(("127.0.0.1", port), timeout=30)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
            continue
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn


def measure(*, quick: bool, repetitions: int, allow_install: bool) -> list[Row]:
    """Loopback TCP bulk fetch and store of the prefix's size and of single blocks."""
    del quick, allow_install  # stdlib only
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(PREFIX_BYTES)], stdout=subprocess.PIPE, text=True
    )
    rows: list[Row] = []
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        conn = _connect(port, timeout_seconds=10)
        inbox = memoryview(bytearray(PREFIX_BYTES))
        outbox = memoryview(bytes(PREFIX_BYTES))
        ack = memoryview(bytearray(1))
        try:

            def fetch(size: int) -> None:
                conn.sendall(HEADER.pack(b"F", size))
                _receive_into(conn, inbox[:size])

            def store(size: int) -> None:
                conn.sendall(HEADER.pack(b"S", size))
                conn.sendall(outbox[:size])
                _receive_into(conn, ack)

            cases = [(prefix_case, "", PREFIX_BYTES, repetitions)] + [
                (single_case, label, size, repetitions * SINGLE_BLOCK_REPETITION_FACTOR)
                for label, size in SINGLE_BLOCK_BYTES.items()
            ]
            for name, label, size, count in cases:
                for operation, work in (("fetch", fetch), ("store", store)):
                    seconds = time_calls(partial(work, size), repetitions=count)
                    case = name(label, operation) if label else name(operation, "bulk")
                    rows += payload_rows(case, SUBJECT, CLIENT, seconds, payload_bytes=size)
        finally:
            conn.close()
    finally:
        stop_process(server)
        if server.stdout is not None:
            server.stdout.close()
    return rows
