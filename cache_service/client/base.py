"""The twins' shared base: each request built as a `_Call`, fail-open and backoff state.

`_BaseCacheClient` does everything but the I/O: it checks the base URL, builds a `_Call`
(method, path, body, the parser of its answer and its fail-open miss), maps a transport error
or a problem answer to a `ServiceError`, keeps the backoff state that decides when a call
skips the network, and counts and logs every fail-open miss (see `failures`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import httpx
import orjson

from cache_service.client.answers import (
    Match,
    Payload,
    ServiceInfo,
    StoreResult,
    _json_object,
    _missed_match,
    _parse_blocks,
    _parse_info,
    _parse_match,
    _parse_store,
)
from cache_service.client.failures import (
    FAILURE_LOG,
    FailOpenCounts,
    FailOpenTally,
    transport_reason,
)
from cache_service.client.problems import response_error
from cache_service.client.transport import Body, body_length
from cache_service.core.blocks import KEY_BYTES, BlockKey, key_from_hex, key_hex
from cache_service.core.errors import InvalidField, ServiceError, ServiceUnavailable
from cache_service.core.framing import MEDIA_TYPE, encode_frames, join_frames
from cache_service.core.tokens import TokenInput, as_token_bytes, tokens_in

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

Clock = Callable[[], float]
FRAME_HEADERS = {"Content-Type": MEDIA_TYPE}
_T = TypeVar("_T")

INSUFFICIENT_STORAGE = 507
# Keys in one fetch: under the service's default max_blocks_per_request (8,192), so a long
# prompt over small blocks is fetched in several requests rather than refused.
FETCH_KEYS = 1024
_MAX_DOUBLINGS = 64  # 2**64 * any sane initial backoff is far past any max: stops float overflow
SCHEMES = ("http", "https")


@dataclass(frozen=True, slots=True)
class _Call(Generic[_T]):
    """One request, how to parse its answer, and its fail-open miss (None: never fails open)."""

    method: str
    path: str
    parse: Callable[[httpx.Response], _T]
    json: dict[str, Any] | None = None
    # A store's frames as chunks: the payloads are sent as they are, never joined into one copy
    # (tens of MB of fresh memory per store) unless an httpx transport needs bytes.
    content: bytes | list[bytes | memoryview] | None = None
    headers: dict[str, str] | None = None
    miss: Callable[[], _T] | None = None
    # Read a frame answer's payloads into bytes of their own (copy=True) rather than the whole
    # body into one buffer that payload views point into (copy=False): each allocates only what
    # it returns, since freeing tens of MB makes glibc hand back pages the next answer faults in.
    frames_apart: bool = False

    def content_bytes(self) -> bytes | None:
        """The body as one bytes object, for httpx's transports."""
        return b"".join(self.content) if isinstance(self.content, list) else self.content


class _BaseCacheClient:
    """Request building, answer parsing and fail-open backoff shared by both twins."""

    def __init__(
        self,
        base_url: str | httpx.URL,
        *,
        fail_open: bool,
        backoff_initial_seconds: float,
        backoff_max_seconds: float,
        clock: Clock,
        metrics_registry: CollectorRegistry | None,
    ) -> None:
        if not 0 <= backoff_initial_seconds <= backoff_max_seconds:
            raise ValueError("need 0 <= backoff_initial_seconds <= backoff_max_seconds")
        self._base_url = checked_base_url(base_url)
        # Named in errors and logs; without user:password, which must never reach a log.
        self._shown_url = str(self._base_url.copy_with(userinfo=b"")).rstrip("/")
        self._tally = FailOpenTally(metrics_registry)
        self._fail_open = fail_open
        self._backoff_initial_seconds = backoff_initial_seconds
        self._backoff_max_seconds = backoff_max_seconds
        self._clock = clock
        self._failures = 0
        self._retry_at = 0.0
        self._epoch = 0  # bumped on every state change; a call's outcome counts only once
        self._base_headers: list[tuple[str, str]] = []  # the twins set their default headers

    @property
    def failures(self) -> FailOpenCounts:
        """Calls answered with a fail-open miss so far, by reason (all 0 without fail_open)."""
        return self._tally.snapshot()

    def _plain_request(
        self, base_url: httpx.URL, call: _Call[Any]
    ) -> tuple[tuple[str, int], str, str, list[tuple[str, str]], Body]:
        """(origin, method, target, headers, body) of a call, for a transport's fast path."""
        body = call.content if call.json is None else orjson.dumps(call.json)
        body = body or b""
        headers = [("Host", base_url.netloc.decode("ascii")), *self._base_headers]
        if call.json is not None:
            headers.append(("Content-Type", "application/json"))
        headers += list((call.headers or {}).items())
        headers.append(("Content-Length", str(body_length(body))))
        target = base_url.raw_path.decode("ascii").rstrip("/") + call.path
        return (base_url.host, base_url.port or 80), call.method, target, headers, body

    @staticmethod
    def _default_headers(api_key: str | None) -> dict[str, str]:
        return {} if api_key is None else {"Authorization": f"Bearer {api_key}"}

    def _build_lookup(
        self,
        model: str,
        tokens: TokenInput,
        *,
        kv_layout: str,
        salt: str | None,
        retention: str | None,
        block_size: int | None,
        fetch: bool,
        copy: bool = True,
    ) -> _Call[Match]:
        token_bytes = as_token_bytes(tokens)
        header = {
            **_prompt_options(
                model, kv_layout=kv_layout, salt=salt, retention=retention, block_size=block_size
            ),
            "fetch": fetch,
        }
        return _Call(
            "POST",
            "/v1/lookup",
            partial(_parse_match, fetch=fetch, copy=copy),
            content=join_frames(encode_frames(header, [token_bytes])),
            headers=FRAME_HEADERS,
            frames_apart=fetch and copy,
            miss=partial(
                _missed_match, model, tokens_in(token_bytes), block_size, retention, fetch
            ),
        )

    def _build_store(
        self,
        model: str,
        tokens: TokenInput,
        payloads: Sequence[bytes | memoryview],
        *,
        kv_layout: str,
        start_block: int,
        salt: str | None,
        retention: str | None,
        block_size: int | None,
    ) -> _Call[StoreResult]:
        token_bytes = as_token_bytes(tokens)
        _check_payloads(payloads)
        header = {
            **_prompt_options(
                model, kv_layout=kv_layout, salt=salt, retention=retention, block_size=block_size
            ),
            "start_block": start_block,
        }
        miss = StoreResult.miss(
            model=model,
            block_size=block_size or 0,
            start_block=start_block,
            requested_blocks=len(payloads),
        )
        return _Call(
            "POST",
            "/v1/blocks",
            _parse_store,
            content=encode_frames(header, [token_bytes, *payloads]),
            headers=FRAME_HEADERS,
            miss=lambda: miss,
        )

    def _build_get_blocks(
        self,
        model: str,
        keys: Sequence[BlockKey | str],
        *,
        kv_layout: str,
        salt: str | None,
        copy: bool = True,
    ) -> _Call[list[Payload | None]]:
        texts = [_key_text(key) for key in keys]
        body = {"model": model, "kv_layout": kv_layout, "salt": salt or "", "keys": texts}
        return _Call(
            "POST",
            "/v1/blocks/fetch",
            partial(_parse_blocks, count=len(texts), copy=copy),
            json=body,
            miss=lambda: [None] * len(texts),
            frames_apart=copy,
        )

    @staticmethod
    def _build_get(path: str) -> _Call[dict[str, Any]]:
        return _Call("GET", path, _json_object)

    @staticmethod
    def _build_info() -> _Call[ServiceInfo]:
        return _Call("GET", "/v1/info", _parse_info)

    def _short_circuit(self, call: _Call[_T]) -> Callable[[], _T] | None:
        """The call's miss while backing off (skip the network), else None."""
        if not (self._fails_open(call) and self._failures):
            return None
        now = self._clock()
        if now >= self._retry_at:
            return None
        self._tally.add("backoff")
        FAILURE_LOG.note(self._shown_url, now, None)
        return call.miss

    def _on_transport_error(self, call: _Call[_T], epoch: int, exc: httpx.HTTPError) -> _T:
        """Map an httpx error to ServiceUnavailable naming the URL, then fail open or raise."""
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        error = ServiceUnavailable(f"{call.method} {self._shown_url}{call.path}: {text}")
        error.__cause__ = exc
        return self._on_error(call, epoch, error, transport_reason(exc), error.detail)

    def _on_response(self, call: _Call[_T], epoch: int, response: httpx.Response) -> _T:
        """Parse a 2xx answer, or fail open or raise on a problem."""
        where = f"{call.method} {self._shown_url}{call.path}"
        if not response.is_success:
            error = response_error(response)
            reason = "store_full" if error.status == INSUFFICIENT_STORAGE else "status"
            said = f"{where} answered {error.status}: {error.detail}"
            return self._on_error(call, epoch, error, reason, said)
        try:
            result = call.parse(response)
        except ServiceError as error:
            said = f"{where} gave an invalid answer: {error.detail}"
            return self._on_error(call, epoch, error, "invalid_answer", said)
        self._record(call, epoch, failed=False)
        return result

    def _on_error(
        self, call: _Call[_T], epoch: int, error: ServiceError, reason: str, said: str
    ) -> _T:
        """Raise `error`, or with fail_open return the call's miss, counted and logged."""
        if not self._fail_open or call.miss is None or error.status < 500:
            self._record(call, epoch, failed=False)  # any 4xx answer shows the service is up
            raise error
        self._record(call, epoch, failed=error.status != INSUFFICIENT_STORAGE)
        self._tally.add(reason)
        FAILURE_LOG.note(self._shown_url, self._clock(), f"{said} [{reason}]")
        return call.miss()

    def _fails_open(self, call: _Call[Any]) -> bool:
        return self._fail_open and call.miss is not None

    def _record(self, call: _Call[Any], epoch: int, *, failed: bool) -> None:
        """Update the backoff after a call that started at `epoch` (stale outcomes ignored)."""
        if not self._fails_open(call) or epoch != self._epoch:
            return
        if failed:
            self._failures += 1
            self._epoch += 1
            doublings = min(self._failures - 1, _MAX_DOUBLINGS)
            delay = min(self._backoff_initial_seconds * 2.0**doublings, self._backoff_max_seconds)
            self._retry_at = self._clock() + delay
        elif self._failures:
            self._failures = 0
            self._epoch += 1


def checked_base_url(base_url: str | httpx.URL) -> httpx.URL:
    """The base URL, or ValueError unless it is http(s)://host[:port][/path]."""
    try:
        url = httpx.URL(base_url)
    except httpx.InvalidURL as exc:
        raise ValueError(f"base_url {str(base_url)!r} is not a URL: {exc}") from None
    text = str(base_url)
    if "://" not in text:  # "localhost:8080" parses as scheme "localhost": name the fix
        raise ValueError(
            f"base_url {text!r} has no scheme: did you mean 'http://{text.lstrip('/')}'?"
        )
    if url.scheme not in SCHEMES:
        shown = str(url.copy_with(userinfo=b""))
        raise ValueError(
            f"base_url {shown!r}: the scheme must be http or https, not {url.scheme!r}"
        )
    if not url.host:
        raise ValueError(f"base_url {text!r} names no host")
    return url


# Request fields ---------------------------------------------------------------------------


def _key_text(key: BlockKey | str) -> str:
    """A key as the API's 32 lowercase hex characters; InvalidField if it is not a key."""
    try:
        if isinstance(key, bytes):
            if len(key) != KEY_BYTES:
                raise ValueError(f"a block key is {KEY_BYTES} bytes, got {len(key)}")
            return key_hex(key)
        return key_hex(key_from_hex(key))
    except (ValueError, TypeError) as exc:
        raise InvalidField("keys", str(exc)) from None


def _check_payloads(payloads: Sequence[bytes | memoryview]) -> None:
    """TypeError, before anything is sent, for payloads that are not a list of flat bytes."""
    if isinstance(payloads, bytes | bytearray | memoryview | str):
        raise TypeError(
            f"payloads is a list of payloads, one per block, not one {type(payloads).__name__}"
        )
    for index, payload in enumerate(payloads):
        if isinstance(payload, bytes):
            continue  # the usual case, with no view made
        try:
            with memoryview(payload) as view:
                itemsize, ndim, contiguous = view.itemsize, view.ndim, view.c_contiguous
        except TypeError:
            raise TypeError(
                f"payloads[{index}]: a payload is bytes, a bytearray or a memoryview, "
                f"not {type(payload).__name__}"
            ) from None
        if not contiguous:  # sent as it lies in memory: a strided view has gaps
            raise TypeError(f"payloads[{index}]: a payload is contiguous memory: pass bytes(x)")
        if (itemsize, ndim) != (1, 1):  # a frame's length is len(payload), which counts items
            raise TypeError(
                f"payloads[{index}]: a payload is counted in bytes, not in items of {itemsize} "
                f"bytes in {ndim} dimensions: pass memoryview(x).cast('B')"
            )


def _prompt_options(
    model: str,
    *,
    kv_layout: str,
    salt: str | None,
    retention: str | None,
    block_size: int | None,
) -> dict[str, Any]:
    return {
        "model": model,
        "kv_layout": kv_layout,
        "salt": salt or "",
        "retention": retention,
        "block_size": block_size,
    }
