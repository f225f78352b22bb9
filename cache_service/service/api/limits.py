"""Per-key rate quotas at the edge: 429 with Retry-After once a key's quota is spent."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cache_service.core.errors import Throttled
from cache_service.service.api.problems import refuse
from cache_service.service.api_keys import ApiKey


class QuotaGate:
    """ASGI middleware (inside the Authenticator): admits a request against its key's
    buckets and charges the bytes it moved (body in and out) when it ends."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Admit or refuse one request."""
        key: ApiKey | None = scope.get("state", {}).get("principal")
        service = getattr(scope["app"].state, "service", None) if "app" in scope else None
        book = service.quotas if service is not None else None
        if scope["type"] != "http" or key is None or book is None or not key.has_quota:
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        wait = book.admit(key, upfront_bytes=declared)
        if wait is not None:
            seconds, quota = wait
            await refuse(send, scope, Throttled(
                f"key {key.id!r} has spent its {quota} quota; retry in {seconds:.2f} s",
                retry_after_seconds=seconds, limit=quota,
            ))  # fmt: skip
            return
        moved = 0

        async def counting_receive() -> Message:
            nonlocal moved
            message = await receive()
            moved += len(message.get("body", b""))
            return message

        async def counting_send(message: Message) -> None:
            nonlocal moved
            if message["type"] == "http.response.body":
                moved += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, counting_receive, counting_send)
        finally:
            book.spend_bytes(key, moved - declared)


def _declared_length(scope: Scope) -> int:
    """The request's Content-Length, or 0."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0
