"""A frame body sent as it was built: the header, then the frames buffer, never joined."""

from __future__ import annotations

from typing import Any

from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from cache_service.core.framing import MEDIA_TYPE, FrameWriter


class FramesResponse(Response):
    """Sends a FrameWriter's head and frames as two body messages, without copying payloads
    into one bytes object first (for 28 MiB of KV that copy costs as much as the read)."""

    media_type = MEDIA_TYPE

    def __init__(self, header: dict[str, Any], frames: FrameWriter) -> None:
        self.head = frames.head(header)
        self.frames = frames.frames
        super().__init__(content=b"", media_type=MEDIA_TYPE)
        self.headers["content-length"] = str(len(self.head) + len(self.frames))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the status, the head, then the frames."""
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        await send({"type": "http.response.body", "body": self.head, "more_body": True})
        await send({"type": "http.response.body", "body": self.frames, "more_body": False})
        if isinstance(self.background, BackgroundTask):
            await self.background()
