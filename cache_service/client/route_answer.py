"""What POST /v1/route answers, typed: per instance and medium how much of a prompt it holds,
the payload store's share, and the best of them; and the call that asks it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from cache_service.client.answers import _json_object, _read_fields
from cache_service.client.base import _Call
from cache_service.core.tokens import TokenInput, as_token_bytes, bytes_to_tokens
from cache_service.wire import answers

InstanceHold = answers.RouteInstance  # instance None: the payload store (medium "store")
StoreHold = answers.RouteStore


@dataclass(frozen=True, slots=True)
class RouteAnswer:
    """A routing question's answer: instances best first, the store, the best of all."""

    model: str
    prompt_tokens: int
    instances: list[InstanceHold]
    store: StoreHold
    best: InstanceHold | None  # None when nothing holds a single block of the prompt
    unscored: dict[str, str]  # engine -> why its blocks cannot be matched to a prompt


def build_route_call(
    model: str,
    tokens: TokenInput,
    *,
    kv_layout: str,
    salt: str | None,
    retention: str | None,
    block_size: int | None,
    lora_name: str | None,
    cache_salt: str | None,
    instances: Sequence[str] | None,
) -> _Call[RouteAnswer]:
    """The POST /v1/route call (no fail-open miss: a router must know it had no answer)."""
    token_bytes = as_token_bytes(tokens)  # validates; the JSON body carries the ids
    body: dict[str, Any] = {
        "model": model,
        "tokens": bytes_to_tokens(token_bytes),
        "kv_layout": kv_layout,
        "salt": salt or "",
        "retention": retention,
        "block_size": block_size,
        "lora_name": lora_name,
        "cache_salt": cache_salt,
        "instances": None if instances is None else list(instances),
    }
    return _Call("POST", "/v1/route", parse_route, json=body)


def parse_route(response: httpx.Response) -> RouteAnswer:
    """A RouteAnswer from a 2xx answer; ServiceError(502) for one it cannot use."""
    fields = _read_fields(answers.RouteResponse, _json_object(response))
    unscored: list[answers.RouteUnscored] = fields.pop("unscored")
    return RouteAnswer(**fields, unscored={row.instance: row.reason for row in unscored})
