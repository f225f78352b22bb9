"""Which engines hold the longest prefix of a request's prompt: its token ids from an engine's
`POST /tokenize` (vLLM's), then the cache service's `POST /v1/route` over the healthy engines'
names.

The answer is advice: when either call fails or is slow (each is bounded by the route
timeout), the request goes on with no preference (engines chosen by requests in flight), the
failure counted by step and logged at most once per interval.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeGuard

import httpx

from cache_service.client import AsyncCacheClient, RouteAnswer, UnknownInstanceProblem
from cache_service.core.errors import PromptCacheError
from cache_service.tools.pd_proxy.engines import Engine, EnginePool
from cache_service.tools.pd_proxy.metrics import ProxyMetrics
from cache_service.tools.pd_proxy.options import ROLES
from cache_service.tools.pd_proxy.reporting import ThrottledLog, describe_error

# Chat fields that change what the chat template renders, passed to /tokenize as sent.
TEMPLATE_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "add_special_tokens",
)


class PrefixPlacement:
    """Asks how many tokens of a prompt each engine holds; {} when it cannot tell."""

    def __init__(
        self,
        *,
        pool: EnginePool,
        client: httpx.AsyncClient,
        cache: AsyncCacheClient | None,
        metrics: ProxyMetrics,
        timeout_seconds: float,
    ) -> None:
        self._pool = pool
        self._client = client
        self._cache = cache
        self._metrics = metrics
        self._timeout_seconds = timeout_seconds
        self._log = ThrottledLog()

    async def held_tokens(
        self, body: Mapping[str, Any], *, chat: bool, headers: Mapping[str, str]
    ) -> dict[str, int]:
        """Tokens of the prompt each engine holds, by engine name ({}: no preference)."""
        model = body.get("model")
        if self._cache is None or not isinstance(model, str):
            return {}
        healthy = [*self._pool.healthy("prefill"), *self._pool.healthy("decode")]
        names = list(dict.fromkeys(engine.name for engine in healthy))
        if not names:
            return {}
        tokens = await self._tokens(body, chat=chat, headers=headers)
        if tokens is None:
            return {}
        salt = body.get("cache_salt")
        cache_salt = salt if isinstance(salt, str) else None
        try:
            try:
                answer = await self._cache.route(
                    model, tokens, instances=names, cache_salt=cache_salt
                )
            except UnknownInstanceProblem as exc:
                # Some engines publish no KV events the service follows (a 422 for the whole
                # question): ask about every engine it follows, and use the rows of ours.
                why = exc.detail
                self._log.warning("unknown-instance", "asking /v1/route of every engine: %s", why)
                answer = await self._cache.route(model, tokens, cache_salt=cache_salt)
        except (PromptCacheError, ValueError) as exc:
            self._failed("route", f"POST /v1/route failed: {exc}")
            return {}
        return held_by_engine(answer)

    async def _tokens(
        self, body: Mapping[str, Any], *, chat: bool, headers: Mapping[str, str]
    ) -> list[int] | None:
        """The prompt's token ids; None when it has none to route by (a batch of prompts) or
        /tokenize failed (counted)."""
        question = tokenize_body(body, chat=chat)
        if question is None:
            prompt = body.get("prompt")
            return prompt if not chat and _is_token_list(prompt) else None
        engine = self._tokenizer()
        if engine is None:
            return None
        try:
            response = await self._client.post(
                engine.url + "/tokenize",
                json=question,
                headers=dict(headers),
                timeout=self._timeout_seconds,
            )
        except httpx.HTTPError as exc:
            self._failed("tokenize", f"{engine.describe()} /tokenize: {describe_error(exc)}")
            return None
        tokens = _answer_tokens(response)
        if tokens is None:
            status = response.status_code
            self._failed("tokenize", f"{engine.describe()} /tokenize answered {status}, no tokens")
        return tokens

    def _tokenizer(self) -> Engine | None:
        # An idle prefill engine first: decode engines are the ones streaming tokens.
        for role in ROLES:
            healthy = self._pool.healthy(role)
            if healthy:
                return min(healthy, key=lambda engine: engine.in_flight)
        return None

    def _failed(self, reason: str, message: str) -> None:
        self._metrics.route_failures.labels(reason).inc()
        self._log.warning(reason, "choosing engines by requests in flight: %s", message)


def tokenize_body(body: Mapping[str, Any], *, chat: bool) -> dict[str, Any] | None:
    """vLLM's /tokenize question for a request's prompt; None when there is no text to ask
    about (token ids already, or a batch of prompts)."""
    model = body.get("model")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        question = {"model": model, "messages": messages}
        question.update({name: body[name] for name in TEMPLATE_FIELDS if name in body})
        return question
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        return None
    question = {"model": model, "prompt": prompt}
    if "add_special_tokens" in body:
        question["add_special_tokens"] = body["add_special_tokens"]
    return question


def held_by_engine(answer: RouteAnswer) -> dict[str, int]:
    """The most tokens each live engine holds in any medium, by name."""
    held: dict[str, int] = {}
    for row in answer.instances:
        if row.instance is not None and row.live:
            held[row.instance] = max(held.get(row.instance, 0), row.cached_tokens)
    return held


def _is_token_list(value: Any) -> TypeGuard[list[int]]:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )


def _answer_tokens(response: httpx.Response) -> list[int] | None:
    if response.status_code != 200:
        return None
    try:
        tokens = response.json().get("tokens")
    except (ValueError, AttributeError):
        return None
    return tokens if _is_token_list(tokens) else None
