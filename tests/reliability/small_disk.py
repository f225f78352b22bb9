"""A small real file system (tmpfs) for a data folder, and an HTTP session that keeps every
status it saw, so that a test can say no request anywhere answered 500."""

from __future__ import annotations

import collections
import errno
import hashlib
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from cache_service.core.framing import MEDIA_TYPE, decode_frames, encode_frames, join_frames

PROBLEM_JSON = "application/problem+json"
BLOCK_TOKENS = 16


@contextmanager
def tmpfs(mount_point: Path, size_bytes: int) -> Iterator[Path]:
    """Mount a tmpfs of `size_bytes` on `mount_point`, unmounted on exit. Needs root: skipped
    without it on a developer's machine, a failure under CI=true (CI runs as root)."""
    in_ci = os.environ.get("CI", "").lower() == "true"
    if os.geteuid() != 0:
        reason = "mounting a tmpfs needs root (CI runs these tests as root)"
        if in_ci:
            pytest.fail(reason)
        pytest.skip(reason)
    mount_point.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        reason = f"cannot mount a tmpfs: {mounted.stderr.strip()}"
        if in_ci:
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(path: Path) -> int:
    """Write a file at `path` until its file system is full (another program filling the
    disk); the bytes it took."""
    written = 0
    with path.open("wb", buffering=0) as handle:
        for chunk in (bytes(2**20), bytes(4096)):
            while True:
                try:
                    wrote = handle.write(chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
                written += wrote or 0
                if not wrote:
                    break
    return written


def prompt_tokens(index: int, blocks: int) -> list[int]:
    """The tokens of prompt `index`: `blocks` full blocks, shared with no other prompt."""
    return [index * 100_000 + t for t in range(BLOCK_TOKENS * blocks)]


def payload(index: int, block: int, size: int) -> bytes:
    """A payload known from its prompt and block alone (a read checks the bytes)."""
    seed = hashlib.sha256(f"{index}/{block}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


class Session:
    """An HTTP client to one server that counts every status it got."""

    def __init__(self, base_url: str) -> None:
        self.client = httpx.Client(base_url=base_url, timeout=60.0)
        self.statuses: collections.Counter[int] = collections.Counter()
        self.server_errors: list[str] = []

    def _seen(self, response: httpx.Response) -> httpx.Response:
        self.statuses[response.status_code] += 1
        if response.status_code == 500:
            self.server_errors.append(f"{response.request.url.path}: {response.text[:300]}")
        return response

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        """POST, counted."""
        return self._seen(self.client.post(path, **kwargs))

    def get(self, path: str) -> httpx.Response:
        """GET, counted."""
        return self._seen(self.client.get(path))

    def store(
        self, index: int, blocks: int, size: int, *, binary_tokens: bool = False
    ) -> httpx.Response:
        """Store prompt `index`'s blocks: a frame body, the tokens in its JSON header or, with
        `binary_tokens`, in its first frame (uint32 little-endian)."""
        payloads: list[bytes | memoryview | None] = [
            payload(index, block, size) for block in range(blocks)
        ]
        tokens = prompt_tokens(index, blocks)
        header: dict[str, Any] = {"model": "m"}
        if binary_tokens:
            payloads.insert(0, b"".join(t.to_bytes(4, "little") for t in tokens))
        else:
            header["tokens"] = tokens
        body = join_frames(encode_frames(header, payloads))
        return self.post("/v1/blocks", content=body, headers={"content-type": MEDIA_TYPE})

    def pin(self, index: int, blocks: int) -> httpx.Response:
        """Pin prompt `index`: its blocks are then never evicted."""
        return self.post("/v1/pin", json={"model": "m", "tokens": prompt_tokens(index, blocks)})

    def matched_blocks(self, index: int, blocks: int) -> int:
        """How many of prompt `index`'s blocks a lookup finds."""
        return int(self.lookup(index, blocks)["matched_blocks"])

    def lookup(self, index: int, blocks: int) -> dict[str, Any]:
        """The answer of a lookup of prompt `index`."""
        body = {"model": "m", "tokens": prompt_tokens(index, blocks)}
        answer = self.post("/v1/lookup", json=body)
        assert answer.status_code == 200, answer.text
        found: dict[str, Any] = answer.json()
        return found

    def fetch(self, index: int, blocks: int) -> list[bytes | None]:
        """Prompt `index`'s payloads, looked up then fetched by key."""
        keys = self.lookup(index, blocks)["keys"]
        answer = self.post("/v1/blocks/fetch", json={"model": "m", "keys": keys})
        assert answer.status_code == 200, answer.text
        _header, frames = decode_frames(answer.content)
        return [bytes(frame) if frame is not None else None for frame in frames]

    def metric(self, sample: str) -> float | None:
        """One sample of /metrics ('name' or 'name{label="value"}'), None if absent."""
        for line in self.get("/metrics").text.splitlines():
            if not line.startswith("#") and line.rsplit(" ", 1)[0] == sample:
                return float(line.rsplit(" ", 1)[1])
        return None

    def close(self) -> None:
        """Close the connection pool."""
        self.client.close()
