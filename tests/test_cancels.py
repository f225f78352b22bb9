"""AnswerCancelled: the request a stopping server cancels is answered 503 (uvicorn: 500)."""

from __future__ import annotations

import asyncio
import contextlib

import orjson
from prometheus_client import CollectorRegistry
from starlette.types import Message, Receive, Scope, Send

from cache_service.service.api.app import RequestTimer, create_app
from cache_service.service.api.cancels import AnswerCancelled
from cache_service.service.metrics import CacheMetrics

SCOPE: Scope = {"type": "http", "path": "/v1/blocks", "method": "POST", "headers": []}


async def _cancelled_request(
    answer_first: bool, metrics: CacheMetrics | None = None
) -> tuple[list[Message], bool]:
    sent: list[Message] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if answer_first:
            await send({"type": "http.response.start", "status": 200, "headers": []})
        await asyncio.Event().wait()  # a body that never arrives

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    stack = AnswerCancelled(app)
    if metrics is not None:  # as create_app stacks them: the timer outside
        stack = RequestTimer(stack, metrics=metrics)  # type: ignore[assignment]
    task = asyncio.ensure_future(stack(SCOPE, receive, send))
    await asyncio.sleep(0.01)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return sent, task.cancelled()


def test_a_cancelled_request_without_an_answer_gets_a_503_problem() -> None:
    sent, cancelled = asyncio.run(_cancelled_request(answer_first=False))
    assert not cancelled
    assert sent[0]["status"] == 503
    problem = orjson.loads(sent[1]["body"])
    assert problem["status"] == 503 and "stopped before this request finished" in problem["detail"]


def test_a_cancelled_request_whose_answer_started_stays_cancelled() -> None:
    sent, cancelled = asyncio.run(_cancelled_request(answer_first=True))
    assert cancelled
    assert [message["status"] for message in sent] == [200]


def test_the_request_counter_counts_a_cancelled_request_as_the_503_it_got() -> None:
    metrics = CacheMetrics(CollectorRegistry())
    sent, _ = asyncio.run(_cancelled_request(answer_first=False, metrics=metrics))
    assert sent[0]["status"] == 503
    sample = metrics.registry.get_sample_value
    assert sample("prompt_cache_requests_total", {"route": "other", "code": "503"}) == 1
    assert sample("prompt_cache_requests_total", {"route": "other", "code": "500"}) is None


def test_the_app_stacks_the_request_counter_outside_the_cancel_answer() -> None:
    """Starlette's first user middleware is the outermost one."""
    names = [entry.cls.__name__ for entry in create_app().user_middleware]  # type: ignore[attr-defined]
    assert names.index("RequestTimer") < names.index("AnswerCancelled")
