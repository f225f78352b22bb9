"""CacheClient: the blocking twin, which sends each `_Call` over one httpx.Client."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import httpx

from cache_service.client.answers import (
    Match,
    Payload,
    ServiceInfo,
    StoredBlocks,
    StoreResult,
    _parse_local_reads,
)
from cache_service.client.base import _T, FETCH_KEYS, Clock, _BaseCacheClient, _Call, _key_text
from cache_service.client.local_reads import (
    LOCAL_READS_PATH,
    LocalRead,
    LocalReadsSetup,
    cut_match,
)
from cache_service.client.route_answer import RouteAnswer, build_route_call
from cache_service.client.transport import StdlibTransport
from cache_service.core.blocks import BlockKey, key_from_hex
from cache_service.core.errors import ServiceError
from cache_service.core.tokens import TokenInput, as_token_bytes

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry


LOCAL_READS_CALL = _Call("GET", LOCAL_READS_PATH, _parse_local_reads)


class CacheClient(_BaseCacheClient):
    """A blocking client of the prompt cache service; one httpx.Client, one connection pool."""

    def __init__(
        self,
        base_url: str | httpx.URL,
        *,
        api_key: str | None = None,
        timeout: float = 5.0,
        fail_open: bool = False,
        transport: httpx.BaseTransport | None = None,
        backoff_initial_seconds: float = 0.5,
        backoff_max_seconds: float = 30.0,
        clock: Clock = time.monotonic,
        metrics_registry: CollectorRegistry | None = None,
        local_reads: bool = False,
        local_reads_path: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(
            base_url,
            fail_open=fail_open,
            backoff_initial_seconds=backoff_initial_seconds,
            backoff_max_seconds=backoff_max_seconds,
            clock=clock,
            metrics_registry=metrics_registry,
        )
        self._fast: StdlibTransport | None = None
        if transport is None and self._base_url.scheme == "http":
            transport = self._fast = StdlibTransport(timeout_seconds=timeout)  # see its doc
        self._base_headers = list(self._default_headers(api_key).items())
        # Same-host reads (see client.local_reads): asked for at the first lookup with fetch.
        self._local = LocalReadsSetup(local_reads, local_reads_path)
        self._http = httpx.Client(
            base_url=self._base_url,
            headers=self._default_headers(api_key),
            timeout=timeout,
            transport=transport,
        )

    def _send(self, call: _Call[_T], while_waiting: Callable[[], object] | None = None) -> _T:
        """Send `call`; on our own transport `while_waiting` runs while the service answers
        (elsewhere not at all: the caller checks)."""
        skipped = self._short_circuit(call)
        if skipped is not None:
            return skipped()
        epoch = self._epoch
        try:
            if self._fast is not None:  # our own transport: no httpx request pipeline needed
                response = self._exchange(call, while_waiting)
            else:
                response = self._http.request(
                    call.method,
                    call.path,
                    json=call.json,
                    content=call.content_bytes(),
                    headers=call.headers,
                )
        except httpx.HTTPError as exc:
            return self._on_transport_error(call, epoch, exc)
        return self._on_response(call, epoch, response)

    def _exchange(
        self, call: _Call[_T], while_waiting: Callable[[], object] | None = None
    ) -> httpx.Response:
        assert self._fast is not None
        plain = self._plain_request(self._http.base_url, call)
        return self._fast.exchange(
            *plain, frames_apart=call.frames_apart, while_waiting=while_waiting
        )

    def lookup(
        self,
        model: str,
        tokens: TokenInput,
        *,
        kv_layout: str = "",
        salt: str | None = None,
        retention: str | None = None,
        block_size: int | None = None,
        fetch: bool = False,
        copy: bool = True,
    ) -> Match:
        """The longest cached prefix of `tokens`; with fetch, its payloads too (read from the
        store's files when `local_reads` is on and the service offers them, see
        `local_reads_status`)."""
        if fetch and self._local.wanted:
            return self._lookup_local(
                model, tokens, kv_layout=kv_layout, salt=salt, retention=retention,
                block_size=block_size, copy=copy,
            )  # fmt: skip
        return self._send(
            self._build_lookup(
                model,
                tokens,
                kv_layout=kv_layout,
                salt=salt,
                retention=retention,
                block_size=block_size,
                fetch=fetch,
                copy=copy,
            )
        )

    def _lookup_local(
        self,
        model: str,
        tokens: TokenInput,
        *,
        kv_layout: str,
        salt: str | None,
        retention: str | None,
        block_size: int | None,
        copy: bool,
    ) -> Match:
        """The lookup over HTTP while the payloads are read from the store's files (see
        client.local_reads); what the files lack of the service's match comes over HTTP."""
        token_bytes = as_token_bytes(tokens)
        reader = self._local.reader(lambda: self._send(LOCAL_READS_CALL))
        if reader is None:
            return self._send(
                self._build_lookup(
                    model, token_bytes, kv_layout=kv_layout, salt=salt, retention=retention,
                    block_size=block_size, fetch=True, copy=copy,
                )
            )  # fmt: skip
        size = reader.block_size(model, block_size)
        reads: list[LocalRead] = []

        def read_files() -> None:  # while the service looks the prompt up
            reads.append(
                reader.read(model, token_bytes, block_size=size, kv_layout=kv_layout, salt=salt)
            )

        lookup = self._build_lookup(
            model, token_bytes, kv_layout=kv_layout, salt=salt, retention=retention,
            block_size=block_size, fetch=False,
        )  # fmt: skip
        match = self._send(lookup, while_waiting=read_files)
        if not match.matched_blocks:
            return cut_match(match, 0, [])
        if not reads:  # another transport, or the service was not asked
            read_files()
        read = reads[0]
        payloads = read.agreed(match)
        missing = list(match.keys[len(payloads) :])
        # Evicted, damaged or not in these files: what the service still has, in requests
        # under its max_blocks_per_request, up to the first block it no longer has.
        for start in range(0, len(missing), FETCH_KEYS):
            fetched = self._fetch(
                model, missing[start : start + FETCH_KEYS], kv_layout=kv_layout, salt=salt,
                copy=copy,
            )  # fmt: skip
            for payload in fetched:
                if payload is None:
                    return cut_match(match, len(payloads), payloads)
                payloads.append(payload)
        return cut_match(match, len(payloads), payloads)

    @property
    def local_reads_status(self) -> str:
        """Same-host reads: "off" (not asked for), "not asked yet", "on: <folder>", or
        "unavailable: <why>"."""
        return self._local.status

    def store(
        self,
        model: str,
        tokens: TokenInput,
        payloads: Sequence[bytes | memoryview],
        *,
        kv_layout: str = "",
        start_block: int = 0,
        salt: str | None = None,
        retention: str | None = None,
        block_size: int | None = None,
    ) -> StoreResult:
        """Store payloads of blocks start_block.. of `tokens`; the service's full answer."""
        return self._send(
            self._build_store(
                model,
                tokens,
                payloads,
                kv_layout=kv_layout,
                start_block=start_block,
                salt=salt,
                retention=retention,
                block_size=block_size,
            )
        )

    def put_prefix(
        self,
        model: str,
        tokens: TokenInput,
        payloads: Sequence[bytes | memoryview],
        *,
        kv_layout: str = "",
        start_block: int = 0,
        salt: str | None = None,
        retention: str | None = None,
        block_size: int | None = None,
    ) -> StoredBlocks:
        """Store blocks start_block.. of `tokens`; the count newly stored, and what of the rest."""
        result = self.store(
            model,
            tokens,
            payloads,
            kv_layout=kv_layout,
            start_block=start_block,
            salt=salt,
            retention=retention,
            block_size=block_size,
        )
        return StoredBlocks(result)

    def get_blocks(
        self,
        model: str,
        keys: Sequence[BlockKey | str],
        *,
        kv_layout: str = "",
        salt: str | None = None,
        copy: bool = True,
    ) -> list[Payload | None]:
        """The payload of each key, in order; None for a block the service no longer has.
        With copy=False each payload is a memoryview into the answer (no copy of the bytes).
        With `local_reads` on, read from the store's files where they hold the key (bytes)."""
        if not keys:
            return []
        if not self._local.wanted:
            return self._fetch(model, keys, kv_layout=kv_layout, salt=salt, copy=copy)
        out: list[Payload | None] = [None] * len(keys)

        def keep(index: int, payload: Payload | None) -> None:
            out[index] = None if payload is None else bytes(payload)

        self.read_blocks(model, keys, keep, kv_layout=kv_layout, salt=salt)
        return out

    def read_blocks(
        self,
        model: str,
        keys: Sequence[BlockKey | str],
        sink: Callable[[int, Payload | None], None],
        *,
        kv_layout: str = "",
        salt: str | None = None,
    ) -> None:
        """Hand each key's payload to `sink(index, view)`, once per key but not in order (None
        for a block the service no longer has); a view is valid only during its call, so the
        caller copies the bytes where they go, once. From the store's files when `local_reads`
        is on and the service offers them, the rest over HTTP in fetches of FETCH_KEYS."""
        texts = [_key_text(key) for key in keys]  # InvalidField for a bad key, before any read
        missing: Sequence[int] = range(len(texts))
        if self._local.wanted and texts:
            reader = self._local.reader(lambda: self._send(LOCAL_READS_CALL))
            if reader is not None:
                own = [key_from_hex(text) for text in texts]
                missing = reader.read_blocks(
                    model, own, kv_layout=kv_layout, salt=salt, sink=sink
                )  # fmt: skip
        for start in range(0, len(missing), FETCH_KEYS):
            part = missing[start : start + FETCH_KEYS]
            fetched = self._fetch(
                model, [texts[index] for index in part], kv_layout=kv_layout, salt=salt,
                copy=False,
            )  # fmt: skip
            for index, payload in zip(part, fetched, strict=True):
                sink(index, payload)

    def _fetch(
        self,
        model: str,
        keys: Sequence[BlockKey | str],
        *,
        kv_layout: str,
        salt: str | None,
        copy: bool,
    ) -> list[Payload | None]:
        """POST /v1/blocks/fetch for `keys`, in one request."""
        return self._send(
            self._build_get_blocks(model, keys, kv_layout=kv_layout, salt=salt, copy=copy)
        )

    def route(
        self,
        model: str,
        tokens: TokenInput,
        *,
        instances: Sequence[str] | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        kv_layout: str = "",
        salt: str | None = None,
        retention: str | None = None,
        block_size: int | None = None,
    ) -> RouteAnswer:
        """Which instances hold the longest prefix of `tokens` (best first), and how much the
        cache holds for this namespace; never fails open (a router must know)."""
        return self._send(
            build_route_call(
                model,
                tokens,
                kv_layout=kv_layout,
                salt=salt,
                retention=retention,
                block_size=block_size,
                lora_name=lora_name,
                cache_salt=cache_salt,
                instances=instances,
            )
        )

    def info(self) -> ServiceInfo:
        """What a worker must agree with to share the cache: hashing, block sizes, limits."""
        return self._send(self._build_info())

    def stats(self) -> dict[str, Any]:
        """The store's size and the service's hit and miss tokens (an admin's call): the JSON
        object as sent, shaped as `cache_service.wire.reports.StatsResponse`."""
        return self._send(self._build_get("/v1/stats"))

    def healthy(self, *, ready: bool = False) -> bool:
        """The start-up check: /healthz (up) or with ready /readyz (store open) answers 2xx."""
        try:
            self._send(self._build_get("/readyz" if ready else "/healthz"))
        except ServiceError:
            return False
        return True

    def close(self) -> None:
        """Close the connection pool (and the store's files, if read here)."""
        self._local.close()
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
