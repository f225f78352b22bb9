"""The JSON the proxy reads and writes: the client's request, P's copy of it, D's, and the
`kv_transfer_params` P answers with.

P's copy (vLLM's disaggregated proxy's): the request with `max_tokens: 1` (and for chat
`max_completion_tokens: 1`), `n: 1`, `stream: false`, no `stream_options` and no `min_tokens`
(vLLM refuses `min_tokens` above `max_tokens`), and `kv_transfer_params` with
`do_remote_decode: true, do_remote_prefill: false` over any the client sent. D gets the
request as sent, its `kv_transfer_params` updated with P's when P returned a dict (the
`prompt_cache` objects of both merged).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from cache_service.core.errors import MalformedBody

PARAMS = "kv_transfer_params"
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
# Our connector's own options under kv_transfer_params (its REQUEST_PARAMS_KEY): the client's
# (retention, load, store) and P's report (stored_tokens) are merged, not one replacing the other.
CONNECTOR_KEY = "prompt_cache"
FORWARDED_HEADERS = ("authorization",)
REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_CHARS = 200


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One proxied OpenAI endpoint: its metrics label and its path (the same on engines)."""

    name: str
    path: str
    chat: bool


COMPLETIONS = Endpoint("completions", "/v1/completions", chat=False)
CHAT_COMPLETIONS = Endpoint("chat_completions", "/v1/chat/completions", chat=True)


def read_request(raw: bytes) -> dict[str, Any]:
    """The request's JSON object; MalformedBody (400) naming what is wrong."""
    if not raw.strip():
        raise MalformedBody("the body is empty: send a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise MalformedBody(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise MalformedBody(f"the body must be a JSON object, not a JSON {_kind(body)}")
    return body


def prefill_body(body: Mapping[str, Any], *, chat: bool) -> dict[str, Any]:
    """P's copy of the request: one token, not streamed, asked to keep its KV for D."""
    copy = dict(body)
    copy["max_tokens"] = 1
    if chat:
        copy["max_completion_tokens"] = 1
    copy["n"] = 1
    copy["stream"] = False
    copy.pop("stream_options", None)
    copy.pop("min_tokens", None)
    copy[PARAMS] = {**_client_params(body), **PREFILL_PARAMS}
    return copy


def decode_content(raw: bytes, body: Mapping[str, Any], params: dict[str, Any] | None) -> bytes:
    """D's body: the request as sent, with P's params over the client's when P gave some."""
    if params is None:
        return raw
    client = _client_params(body)
    merged = {**client, **params}
    ours, theirs = client.get(CONNECTOR_KEY), params.get(CONNECTOR_KEY)
    if isinstance(ours, dict) and isinstance(theirs, dict):  # the client's options kept
        merged[CONNECTOR_KEY] = {**ours, **theirs}
    return orjson.dumps({**body, PARAMS: merged})


def returned_params(answer: bytes) -> dict[str, Any] | None:
    """The `kv_transfer_params` object of P's JSON answer; None when absent, null or not an
    object (or the answer is not JSON)."""
    try:
        parsed = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    params = parsed.get(PARAMS) if isinstance(parsed, dict) else None
    return params if isinstance(params, dict) else None


def wants_stream(body: Mapping[str, Any]) -> bool:
    """Whether the client asked for a streamed answer."""
    return body.get("stream") is True


def engine_headers(client_headers: Mapping[str, str]) -> dict[str, str]:
    """The headers of a request to an engine: the client's Authorization as sent, its
    X-Request-Id (or a new one, the same for P and D), JSON, and no compression (bytes are
    passed through as they arrive)."""
    headers = {name: client_headers[name] for name in FORWARDED_HEADERS if name in client_headers}
    request_id = client_headers.get(REQUEST_ID_HEADER, "")[:MAX_REQUEST_ID_CHARS]
    headers[REQUEST_ID_HEADER] = request_id or f"pd-{uuid.uuid4().hex}"
    headers["content-type"] = "application/json"
    headers["accept-encoding"] = "identity"
    return headers


def _client_params(body: Mapping[str, Any]) -> dict[str, Any]:
    params = body.get(PARAMS)
    return dict(params) if isinstance(params, dict) else {}


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return "number"
