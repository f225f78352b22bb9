"""Load for the graceful-shutdown tests: writers, readers and slow uploads against a real
server that is stopped with SIGTERM while they run; every 2xx store is remembered, so that it
can be checked after a restart on the same folder.

Payloads derive from the tokens (workload.py), so every byte read back is checked on its own.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable

from cache_service.client import CacheClient
from cache_service.core.errors import ServiceError, ServiceUnavailable
from cache_service.core.framing import MEDIA_TYPE, encode_frames, join_frames
from tests.reliability.workload import Prompt, PromptSet, Verifier

# What a client may meet while a server stops: refused (503: not ready, or the store takes no
# new work) or a closed connection. Anything else is a finding.
EXPECTED_STATUSES = {503}


class Acks:
    """Stores answered 2xx: per prompt the blocks acknowledged (never shrinks)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.blocks: dict[str, int] = {}
        self.stores = 0
        self.fresh: set[str] = set()  # prompts acknowledged since the last check

    def before(self, prompt: Prompt) -> int:
        """The blocks of `prompt` acknowledged so far (before a request is sent)."""
        with self.lock:
            return self.blocks.get(prompt.name, 0)

    def acknowledged(self, prompt: Prompt, end: int) -> None:
        """A 2xx answered a store of blocks ..end-1."""
        with self.lock:
            self.blocks[prompt.name] = max(self.blocks.get(prompt.name, 0), end)
            self.stores += 1
            self.fresh.add(prompt.name)

    def take_fresh(self, prompts: PromptSet) -> list[Prompt]:
        """The prompts acknowledged since the last call (older ones were checked then, and
        the final check covers them all again)."""
        with self.lock:
            names, self.fresh = self.fresh, set()
        return [prompt for prompt in prompts.made() if prompt.name in names]


class Load:
    """Threads running one kind of work in a loop until `stop`."""

    def __init__(
        self, url: str, prompts: PromptSet, acks: Acks, verifier: Verifier, seed: int
    ) -> None:
        self.url = url
        self.prompts = prompts
        self.acks = acks
        self.verifier = verifier
        self.seed = seed
        self.outcomes: Counter[str] = Counter()
        self.unexpected: list[str] = []
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.threads: list[threading.Thread] = []

    def start(self, writers: int = 0, readers: int = 0, slow: int = 0) -> None:
        """Start the threads: store loops, read loops, and slow uploads over raw sockets."""
        works: list[Callable[[random.Random], None]] = []
        works += [self._writer] * writers + [self._reader] * readers + [self._slow] * slow
        for n, work in enumerate(works):
            rng = random.Random(self.seed * 1000 + n)
            thread = threading.Thread(target=work, args=(rng,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def stop(self) -> None:
        """End the threads (each ends its request first)."""
        self.done.set()
        for thread in self.threads:
            thread.join(timeout=30)
            assert not thread.is_alive(), "a load thread did not end"

    def _count(self, kind: str) -> None:
        with self.lock:
            self.outcomes[kind] += 1

    def _refused(self, error: ServiceError) -> None:
        if isinstance(error, ServiceUnavailable):
            self._count("transport")
        elif error.status in EXPECTED_STATUSES:
            self._count(str(error.status))
        else:
            with self.lock:
                self.unexpected.append(f"{error.status}: {error.detail}")
        time.sleep(0.05)  # the server is stopping: do not spin

    def _loop(self, rng: random.Random, work: Callable[[CacheClient, random.Random], None]) -> None:
        with CacheClient(self.url, timeout=30.0) as client:
            while not self.done.is_set():
                try:
                    work(client, rng)
                except ServiceError as error:
                    self._refused(error)

    def _writer(self, rng: random.Random) -> None:
        self._loop(rng, self._store)

    def _reader(self, rng: random.Random) -> None:
        self._loop(rng, self._read)

    def _store(self, client: CacheClient, rng: random.Random) -> None:
        prompt = self.prompts.pick(rng)
        done = self.acks.before(prompt)
        if done >= prompt.blocks:
            start = rng.randrange(prompt.blocks)  # a refresh, from anywhere
        else:
            start = done if done and rng.random() < 0.7 else 0  # continue the stored prefix
        end = rng.randint(start + 1, prompt.blocks)
        tokens = prompt.tokens[: end * prompt.block_size]
        result = client.store(prompt.model, tokens, prompt.payloads(start, end), start_block=start)
        if result.keys != prompt.keys[start:end] or result.truncated_blocks:
            self.verifier.wrong.append(f"{prompt.name}: store answered {result}")
        self.acks.acknowledged(prompt, end)
        self._count("store")

    def _read(self, client: CacheClient, rng: random.Random) -> None:
        prompt = self.prompts.pick(rng)
        at_least = self.acks.before(prompt)
        roll = rng.random()
        if roll < 0.4:
            match = client.lookup(prompt.model, prompt.tokens, fetch=True)  # in a thread
            self.verifier.check_match(prompt, match, at_least=at_least)
            self._count("lookup_fetch")
        elif roll < 0.7:
            match = client.lookup(prompt.model, prompt.tokens)  # records a deferred refresh
            self.verifier.check_match(prompt, match, at_least=at_least)
            self._count("lookup")
        elif roll < 0.95:
            payloads = client.get_blocks(prompt.model, prompt.keys)
            self.verifier.check_fetch(prompt, payloads, at_least=at_least)
            self._count("fetch")
        else:
            client.stats()  # reads the store's usage in a thread
            self._count("stats")

    def _slow(self, rng: random.Random) -> None:
        """Upload whole prompts over a raw socket, the body in small pieces with pauses, so
        that a SIGTERM finds the body half received."""
        while not self.done.is_set():
            prompt = self.prompts.pick(rng)
            self.acks.before(prompt)
            status = send_slowly(self.url, prompt, seconds=rng.uniform(0.3, 2.5))
            if status is None:
                self._count("slow_cut")
                time.sleep(0.05)  # stopping, or stopped: do not spin
            elif 200 <= status < 300:
                self.acks.acknowledged(prompt, prompt.blocks)
                self._count("slow_store")
            elif status in EXPECTED_STATUSES:
                self._count(f"slow_{status}")
            else:
                with self.lock:
                    self.unexpected.append(f"slow upload answered {status}")


def store_body(prompt: Prompt) -> bytes:
    """The frames of a store of the whole prompt from block 0 (tokens in frame 0)."""
    header = {"model": prompt.model, "start_block": 0}
    frames = [prompt.token_bytes, *prompt.payloads(0, prompt.blocks)]
    return join_frames(encode_frames(header, frames))


def send_slowly(url: str, prompt: Prompt, *, seconds: float, pieces: int = 20) -> int | None:
    """POST a store whose body takes about `seconds` to arrive; the answer's status, or None
    if the server closed the connection (or was not listening)."""
    host, port = url.removeprefix("http://").split(":")
    body = store_body(prompt)
    head = (
        f"POST /v1/blocks HTTP/1.1\r\nHost: {host}\r\nContent-Type: {MEDIA_TYPE}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    step = -(-len(body) // pieces)
    try:
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(head)
            for offset in range(0, len(body), step):
                sock.sendall(body[offset : offset + step])
                time.sleep(seconds / pieces)
            answer = sock.makefile("rb").readline()
    except OSError:
        return None
    parts = answer.split()
    return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None


def check_prompts(
    url: str, prompts: list[Prompt], acks: Acks, verifier: Verifier, *, thorough: bool
) -> int:
    """On a restarted, idle server: each prompt's acknowledged blocks are all there, every
    byte right (a lookup that fetches); `thorough`: also a fetch by keys, which must agree
    and be prefix-closed. The number of acknowledged blocks checked."""
    checked = 0
    with CacheClient(url, timeout=30.0) as client:
        for prompt in prompts:
            at_least = acks.blocks.get(prompt.name, 0)
            match = client.lookup(prompt.model, prompt.tokens, fetch=True)
            matched = verifier.check_match(prompt, match, at_least=at_least)
            checked += at_least
            if not thorough:
                continue
            payloads = client.get_blocks(prompt.model, prompt.keys)
            found = verifier.check_fetch(prompt, payloads, at_least=at_least)
            if found != matched:
                verifier.wrong.append(f"{prompt.name}: lookup matched {matched}, fetch {found}")
    return checked
