"""AnswerCancelled: the request a stopping server cancels is answered 503 (uvicorn: 500)."""

from __future__ import annotations

import asyncio
import contextlib

import orjson
from starlette.types import Message, Receive, Scope, Send

from cache_service.service.api.cancels import AnswerCancelled

SCOPE: Scope = {"type": "http", "path": "/v1/blocks", "method": "POST", "headers": []}


async def _cancelled_request(answer_first: bool) -> tuple[list[Message], bool]:
    sent: list[Message] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if answer_first:
            await send({"type": "http.response.start", "status": 200, "headers": []})
        await asyncio.Event().wait()  # a body that never arrives

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    task = asyncio.ensure_future(AnswerCancelled(app)(SCOPE, receive, send))
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
