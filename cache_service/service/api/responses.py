"""Answers as sent: a frame body (the header, then the frames buffer, never joined), and an
answer dataclass as the JSON object the stdlib encoders take."""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import TYPE_CHECKING, Any

from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from cache_service.core.framing import MEDIA_TYPE, FrameWriter

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


def json_object(answer: DataclassInstance) -> dict[str, Any]:
    """An answer (cache_service.wire.answers) as its JSON object, fields in declared order."""
    return {item.name: _json_value(getattr(answer, item.name)) for item in fields(answer)}


def _json_value(value: Any) -> Any:
    if is_dataclass(value):
        return json_object(value)  # type: ignore[arg-type]  # an instance: answers hold no classes
    if isinstance(value, list) and value and is_dataclass(value[0]):
        return [json_object(item) for item in value]
    return value  # lists of keys go as they are: no copy of hundreds of strings


class FramesResponse(Response):
    """Sends a FrameWriter's head, then its chunks, as body messages, without copying payloads
    into one bytes object first (for 28 MiB of KV that copy costs as much as the read)."""

    media_type = MEDIA_TYPE

    def __init__(self, header: DataclassInstance, frames: FrameWriter) -> None:
        self.head = frames.head(json_object(header))
        self.chunks = frames.body_chunks()
        super().__init__(content=b"", media_type=MEDIA_TYPE)
        self.headers["content-length"] = str(len(self.head) + frames.size)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the status, the head, then the frames' chunks."""
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        await send({"type": "http.response.body", "body": self.head, "more_body": True})
        for chunk in self.chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        if isinstance(self.background, BackgroundTask):
            await self.background()
