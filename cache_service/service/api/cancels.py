"""AnswerCancelled: a request the server cancels while it stops is answered 503, not 500.

uvicorn cancels the requests still open when its graceful timeout (--shutdown-timeout) ends,
say an upload whose body is still trickling in, and answers each with a bare 500 ("Exception
in ASGI application"). Nothing went wrong with the request: the service is stopping. So the
cancellation is answered here as what it is, a 503 problem the client may retry (a store is
idempotent: if its write still committed in its thread, storing it again refreshes it).
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cache_service.core.errors import NotReady
from cache_service.service.api.problems import refuse


class AnswerCancelled:
    """ASGI middleware: a cancelled request with no answer started gets a 503 problem."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run one request; answer its cancellation."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if started or task is None:
                raise  # half an answer cannot be taken back: the connection just ends
            # The only canceller of a request is the server stopping; the task ends here,
            # answered, so the cancellation is spent.
            task.uncancel()
            error = NotReady(
                "the service stopped before this request finished; retry it (a store whose "
                "write was under way may have been applied: storing again is harmless)"
            )
            await refuse(send, scope, error)
