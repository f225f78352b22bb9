"""A fake vLLM OpenAI server for the proxy's tests, restated from vLLM's API and sharing no
code with the proxy: /health, /tokenize, /v1/models, /v1/completions and
/v1/chat/completions (JSON or SSE), answering deterministic text.

It records every request it receives, echoes the `kv_transfer_params` it got in its answer
(`received_kv_transfer_params`), and like a kv_producer answers a request carrying
`do_remote_decode` with `kv_transfer_params` for the decode engine. A test makes it fail by
setting `behaviour` (the engine runs in a thread of the test's process):

    None      answer normally
    "500"     answer 500 with an OpenAI error object
    "hang"    never answer (until the server stops)
    "cut"     begin the answer, then close the connection mid-way (stream or JSON)
    "stall"   begin a stream, then send nothing more (until the server stops)

and `health_status` (GET /health's) and `tokenize_status` (POST /tokenize's) likewise.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from tests.pd_proxy.servers import ThreadedServer

MODEL = "fake-model"
PREFILL_ANSWER_PARAMS = {"do_remote_prefill": True, "prompt_cache": {"stored_tokens": 42}}
USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
PIECES = ("Hello", " from", " the engine")
HANG_LIMIT_SECONDS = 30.0


class EngineCut(Exception):
    """Raised by the fake to make uvicorn close the connection mid-answer."""


@dataclass(frozen=True)
class Received:
    """One request the engine received."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]


def tokenize(text: str) -> list[int]:
    """The fake's tokenizer: one token per character."""
    return [1000 + ord(char) % 200 for char in text]


def answer_text(name: str) -> str:
    """The whole text an engine answers."""
    return name + ":" + "".join(PIECES)


def stream_events(name: str, body: dict[str, Any], *, chat: bool) -> list[bytes]:
    """The SSE events an engine streams for a request, [DONE] included."""
    events = []
    for index, piece in enumerate((name + ":", *PIECES)):
        choice: dict[str, Any] = {"index": 0, "finish_reason": None}
        if chat:
            choice["delta"] = {"content": piece} if index else {"role": "assistant"}
        else:
            choice["text"] = piece
        events.append(_event({"id": "cmpl-1", "object": _object(chat, True), "choices": [choice]}))
    options = body.get("stream_options") or {}
    if options.get("include_usage"):
        events.append(
            _event({"id": "cmpl-1", "object": _object(chat, True), "choices": [], "usage": USAGE})
        )
    events.append(b"data: [DONE]\n\n")
    return events


def _event(value: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(value) + b"\n\n"


def _object(chat: bool, chunk: bool) -> str:
    if chat:
        return "chat.completion.chunk" if chunk else "chat.completion"
    return "text_completion"


class FakeEngine:
    """One fake engine served on 127.0.0.1 in a thread; `stop()` ends it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.behaviour: str | None = None
        self.health_status = 200
        self.tokenize_status = 200
        self.received: list[Received] = []
        self.stopping = threading.Event()
        app = Starlette(
            routes=[
                Route("/health", self._health, methods=["GET"]),
                Route("/tokenize", self._tokenize, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
            ]
        )
        self._app = app
        self.server = ThreadedServer(self._asgi, name=f"fake engine {name}")

    @property
    def url(self) -> str:
        """The engine's base URL."""
        return self.server.url

    def start(self) -> FakeEngine:
        """Serve until `stop()`."""
        self.server.start()
        return self

    def stop(self) -> None:
        """Release hanging requests and stop serving."""
        self.stopping.set()
        self.server.stop()

    def completions(self) -> list[Received]:
        """The completion requests received (both endpoints), in order."""
        return [r for r in self.received if r.path.endswith("completions")]

    async def _asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path in ("/v1/completions", "/v1/chat/completions"):
            await self._complete(scope, receive, send, chat="chat" in path)
            return
        await self._app(scope, receive, send)

    async def _health(self, request: Request) -> Response:
        return Response(status_code=self.health_status)

    async def _tokenize(self, request: Request) -> Response:
        body = await request.json()
        self.received.append(Received("/tokenize", body, dict(request.headers)))
        if self.tokenize_status != 200:
            return JSONResponse({"error": {"message": "no"}}, status_code=self.tokenize_status)
        if "messages" in body:
            text = "".join(str(message.get("content", "")) for message in body["messages"])
        else:
            text = body["prompt"]
        tokens = tokenize(text)
        return JSONResponse({"count": len(tokens), "max_model_len": 4096, "tokens": tokens})

    async def _models(self, request: Request) -> Response:
        self.received.append(Received("/v1/models", {}, dict(request.headers)))
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "owned_by": self.name}]})

    async def _complete(self, scope: Scope, receive: Receive, send: Send, *, chat: bool) -> None:
        request = Request(scope, receive)
        body = orjson.loads(await request.body())
        self.received.append(Received(scope["path"], body, dict(request.headers)))
        behaviour = self.behaviour
        if behaviour == "hang":
            await self._hang()
            return
        if behaviour == "500":
            error = {"error": {"message": "engine failed", "type": "InternalServerError"}}
            await JSONResponse(error, status_code=500)(scope, receive, send)
            return
        if body.get("stream") is True:
            await self._stream(send, body, chat=chat, behaviour=behaviour)
            return
        answer = orjson.dumps(self._answer(body, chat=chat))
        if behaviour == "cut":  # half the promised bytes, then the connection closes
            await _start(send, 200, b"application/json", len(answer))
            await send({"type": "http.response.body", "body": answer[:10], "more_body": True})
            raise EngineCut("cut mid-answer")
        await _start(send, 200, b"application/json", len(answer))
        await send({"type": "http.response.body", "body": answer})

    async def _stream(
        self, send: Send, body: dict[str, Any], *, chat: bool, behaviour: str | None
    ) -> None:
        await _start(send, 200, b"text/event-stream; charset=utf-8", None)
        events = stream_events(self.name, body, chat=chat)
        for index, event in enumerate(events):
            if behaviour == "cut" and index == 2:
                # Half an event, then the connection closes without the chunked end.
                await send({"type": "http.response.body", "body": event[:9], "more_body": True})
                raise EngineCut("cut mid-stream")
            if behaviour == "stall" and index == 2:
                await self._hang()
                return
            await send({"type": "http.response.body", "body": event, "more_body": True})
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b""})

    async def _hang(self) -> None:
        waited = 0.0
        while not self.stopping.is_set() and waited < HANG_LIMIT_SECONDS:
            await asyncio.sleep(0.05)
            waited += 0.05

    def _answer(self, body: dict[str, Any], *, chat: bool) -> dict[str, Any]:
        received = body.get("kv_transfer_params")
        producing = isinstance(received, dict) and received.get("do_remote_decode") is True
        text = answer_text(self.name)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": "cmpl-1",
            "object": _object(chat, False),
            "model": body.get("model"),
            "choices": [choice],
            "usage": USAGE,
            "kv_transfer_params": PREFILL_ANSWER_PARAMS if producing else None,
            "received_kv_transfer_params": received,
            "engine": self.name,
        }


async def _start(send: Send, status: int, content_type: bytes, length: int | None) -> None:
    headers = [(b"content-type", content_type)]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
