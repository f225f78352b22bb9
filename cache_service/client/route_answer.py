"""What POST /v1/route answers, typed: per instance and medium how much of a prompt it holds,
the payload store's share, and the best of them; and the call that asks it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from cache_service.client.answers import _field, _invalid_answer, _json_object
from cache_service.client.base import _Call
from cache_service.core.tokens import TokenInput, as_token_bytes, bytes_to_tokens

STORE_MEDIUM = "store"  # the medium of `best` when the payload store holds the most


@dataclass(frozen=True, slots=True)
class InstanceHold:
    """One instance's hold on the prompt in one medium (as `best`, maybe the store's)."""

    instance: str | None  # None: the payload store (medium "store")
    medium: str  # GPU, CPU, DISK, or "store"
    matched_blocks: int
    cached_tokens: int
    tokens_to_prefill: int
    block_size: int
    data_parallel_rank: int | None
    stale: bool  # the engine lost events: its view may be wrong
    live: bool = True  # False: the engine's publisher went away (never best)


@dataclass(frozen=True, slots=True)
class StoreHold:
    """The payload store's prefix of the prompt: any worker can load these blocks."""

    matched_blocks: int
    cached_tokens: int
    tokens_to_prefill: int
    block_size: int


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
    body = _json_object(response)
    rows = _field(body, "instances", list)
    best = body.get("best")
    unscored = _field(body, "unscored", list)
    return RouteAnswer(
        model=_field(body, "model", str),
        prompt_tokens=_field(body, "prompt_tokens", int),
        instances=[_hold(row) for row in rows],
        store=_store(_field(body, "store", dict)),
        best=None if best is None else _hold(best),
        unscored={
            _field(_object(item), "instance", str): _field(_object(item), "reason", str)
            for item in unscored
        },
    )


def _object(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _invalid_answer("a route answer's rows are JSON objects")
    return value


def _optional(body: dict[str, Any], name: str, kind: type[Any]) -> Any:
    return None if body.get(name) is None else _field(body, name, kind)


def _hold(value: object) -> InstanceHold:
    row = _object(value)
    return InstanceHold(
        instance=_optional(row, "instance", str),
        medium=_field(row, "medium", str),
        matched_blocks=_field(row, "matched_blocks", int),
        cached_tokens=_field(row, "cached_tokens", int),
        tokens_to_prefill=_field(row, "tokens_to_prefill", int),
        block_size=_field(row, "block_size", int),
        data_parallel_rank=_optional(row, "data_parallel_rank", int),
        stale=_field(row, "stale", bool),
        # Absent from services before liveness: taken as live.
        live=row.get("live") is not False,
    )


def _store(row: dict[str, Any]) -> StoreHold:
    return StoreHold(
        matched_blocks=_field(row, "matched_blocks", int),
        cached_tokens=_field(row, "cached_tokens", int),
        tokens_to_prefill=_field(row, "tokens_to_prefill", int),
        block_size=_field(row, "block_size", int),
    )
