"""Same-host reads: a client on the service's own host reads payloads from the store's files.

A lookup with payloads then goes two ways at once. The lookup itself still goes over HTTP
(without payloads): the service authenticates the key, finds and verifies the longest stored
prefix, records the hit and refreshes the blocks' use, as for any lookup. While the service
works on its own core, between sending the request and reading the answer, the client reads
the prompt's blocks from the LMDB files with the service's own verified read (`LmdbReader`:
each record's checksum, namespace, depth, parent and tokens, each payload's length and
checksum, expiry judged by the service's retention table), in one read transaction, without
a copy through a socket. The service's answer decides the match: the files' payloads past it
are dropped, and what the files lack of it (evicted, damaged, or a folder that is not the
service's) is fetched over HTTP; what neither has ends the match there. A cache may forget
between the two; it never answers with bytes it did not verify.

Payloads asked for by key (`get_blocks`, `read_blocks`: the vLLM connector's loads) come from
the files the same way, verified as the service's own fetch verifies them (the record alive,
of the caller's namespace, the payload's length and checksum); the keys the files lack are
fetched over HTTP.

The service offers this only with --local-reads (GET /v1/local-reads, over loopback), and
the client uses it only when the offer's boot id is its own kernel's and the folder opens as
the very store the service named (its random store id). An offer that cannot be used is asked
for again after `RETRY_SECONDS`, so that a service restarting or a folder mounted late turns
same-host reads on once they work.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import lmdb

from cache_service.client.answers import Match, Payload
from cache_service.core.blocks import BlockKey, Chain, Namespace
from cache_service.core.errors import PromptCacheError
from cache_service.core.hashing import BlockHasher
from cache_service.core.lifetimes import Lifetimes
from cache_service.core.same_host import boot_id
from cache_service.core.store.lmdb.reader import LmdbReader
from cache_service.core.store.parts.backend import PayloadSink
from cache_service.core.tokens import TokenBytes
from cache_service.wire.answers import LocalReadsResponse, Usage

log = logging.getLogger("cache_service.client")
WallClock = Callable[[], float]
LOCAL_READS_PATH = "/v1/local-reads"
RETRY_SECONDS = 60.0  # after an unusable offer or a failed ask, payloads come over HTTP this long


@dataclass(frozen=True)
class LocalRead:
    """What the files held of a prompt: its chain (None if it could not be made), block size
    and leading payloads."""

    chain: Chain | None
    block_size: int
    payloads: list[Payload]

    def agreed(self, match: Match) -> list[Payload]:
        """The payloads of the service's match that this read holds (its leading ones): none
        unless the keys agree, so that a read hashed otherwise never stands in for them."""
        count = min(match.matched_blocks, len(self.payloads))
        if not count or self.chain is None or match.block_size != self.block_size:
            return []
        if self.chain.hex_keys(count) != list(match.keys[:count]):
            return []
        return self.payloads[:count]


class LocalReadsUnavailable(Exception):
    """The service's offer cannot be used from this process (the reason is the message)."""


class LocalReads:
    """The store's files opened read-only for one client, with the hashing and tenant the
    service named."""

    def __init__(
        self,
        offer: LocalReadsResponse,
        *,
        path: str | os.PathLike[str] | None = None,
        host_boot_id: str | None = None,
        wall_clock: WallClock = time.time,
    ) -> None:
        mine = boot_id() if host_boot_id is None else host_boot_id
        if not offer.boot_id or offer.boot_id != mine:
            raise LocalReadsUnavailable(
                f"the service runs on another host (boot id {offer.boot_id or '?'}, "
                f"this one {mine or '?'})"
            )
        lifetimes = Lifetimes(dict(offer.retention), slack_seconds=offer.slack_seconds)
        try:
            self._reader = LmdbReader(path or offer.path, lifetimes=lifetimes)
        except PromptCacheError as exc:
            raise LocalReadsUnavailable(str(exc)) from None
        if not offer.store_id or self._reader.store_id != offer.store_id:
            self._reader.close()
            raise LocalReadsUnavailable(
                f"{self._reader.path} holds store {self._reader.store_id or '(no id)'}, "
                f"not the service's {offer.store_id or '(no id)'}"
            )
        self.path = str(self._reader.path)
        self._hasher = BlockHasher(seed=offer.seed)
        self._tenant = offer.tenant
        self._default_block_size = offer.default_block_size
        self._block_sizes = dict(offer.block_sizes)
        self._clock = wall_clock

    def block_size(self, model: str, given: int | None) -> int:
        """The block size a lookup of `model` uses: the one given, else the service's."""
        return given or self._block_sizes.get(model, self._default_block_size)

    def read(
        self,
        model: str,
        token_bytes: TokenBytes,
        *,
        block_size: int,
        kv_layout: str,
        salt: str | None,
    ) -> LocalRead:
        """The prompt's leading blocks that the files hold, verified, each payload copied out
        of the map (none where the files fail: HTTP then answers)."""
        namespace = Namespace(model, kv_layout, self._tenant, salt or "")
        out: list[Payload] = []
        try:
            chain = self._hasher.chain(namespace, token_bytes, block_size=block_size)
        except ValueError:  # a block size the service refuses as well: it says so
            return LocalRead(None, block_size, out)
        try:
            self._reader.read_prefix(
                self._hasher.namespace_id(namespace),
                chain,
                now=self._clock(),
                sink=lambda _index, payload: out.append(bytes(payload or b"")),
            )
        except (PromptCacheError, lmdb.Error, OSError) as exc:  # fail open: HTTP answers
            log.warning("same-host read of %s failed, fetching over HTTP: %s", self.path, exc)
            out.clear()
        return LocalRead(chain, block_size, out)

    def read_blocks(
        self,
        model: str,
        keys: Sequence[BlockKey],
        *,
        kv_layout: str,
        salt: str | None,
        sink: PayloadSink,
    ) -> list[int]:
        """Hand each key's payload that the files hold, verified, to `sink(index, view)` (a
        view into the map, valid only during the call); the indexes not handed over (absent,
        expired, damaged, or every one left when the files fail: HTTP then answers)."""
        namespace = Namespace(model, kv_layout, self._tenant, salt or "")
        handed = [False] * len(keys)

        def keep(index: int, payload: bytes | memoryview | None) -> None:
            if payload is not None:
                sink(index, payload)
                handed[index] = True

        try:
            self._reader.read_payloads(
                self._hasher.namespace_id(namespace), keys, now=self._clock(), sink=keep
            )
        except (PromptCacheError, lmdb.Error, OSError) as exc:  # fail open: HTTP answers
            log.warning("same-host read of %s failed, fetching over HTTP: %s", self.path, exc)
        return [index for index, done in enumerate(handed) if not done]

    def close(self) -> None:
        """Close the files (and give back the reader slot)."""
        self._reader.close()


class LocalReadsSetup:
    """A client's same-host reads: wanted or not, opened at the first use, or why not."""

    def __init__(
        self,
        wanted: bool,
        path: str | os.PathLike[str] | None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.wanted = wanted
        self._path = path
        self._reads: LocalReads | None = None
        self._lock = threading.Lock()
        self._clock = clock
        self._ask_after = -math.inf
        self.status = "not asked yet" if wanted else "off"

    def reader(self, ask: Callable[[], LocalReadsResponse]) -> LocalReads | None:
        """The open reader; a call without one asks the service (`ask`) and opens the files,
        at most once per RETRY_SECONDS: meanwhile payloads come over HTTP (logged)."""
        with self._lock:
            if self._reads is None and self.wanted and self._clock() >= self._ask_after:
                try:
                    self._reads = LocalReads(ask(), path=self._path)
                    self.status = f"on: {self._reads.path}"
                except (LocalReadsUnavailable, PromptCacheError, OSError) as exc:
                    self._ask_after = self._clock() + RETRY_SECONDS
                    self.status = f"unavailable: {exc}"
                    log.warning(
                        "same-host reads off for %.0f s, payloads come over HTTP: %s",
                        RETRY_SECONDS, exc,
                    )  # fmt: skip
            return self._reads

    def close(self) -> None:
        """Close the files if they were opened."""
        with self._lock:
            if self._reads is not None:
                self._reads.close()
                self._reads = None
            if self.wanted:  # no files are opened again after the client closed
                self.wanted = False
                self.status = "closed"


def cut_match(match: Match, blocks: int, payloads: list[Payload]) -> Match:
    """`match` with its payloads, cut to its first `blocks` blocks when fewer were found."""
    if blocks >= match.matched_blocks:
        return replace(match, payloads=payloads)
    hit = blocks * match.block_size
    return replace(
        match,
        matched_blocks=blocks,
        cached_tokens=hit,
        keys=list(match.keys[:blocks]),
        usage=Usage(
            prompt_cache_hit_tokens=hit, prompt_cache_miss_tokens=match.prompt_tokens - hit
        ),
        payloads=payloads[:blocks],
    )
