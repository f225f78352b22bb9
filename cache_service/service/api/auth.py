"""Authentication: every request but the health checks carries an API key with a role.

An ASGI middleware, so that every route, including the thin hot paths and any route added
later, is covered by one check; a route not listed in `ROUTE_ROLES` needs an admin key.
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from cache_service.core.errors import Forbidden, Unauthorized
from cache_service.service.api.problems import refuse
from cache_service.service.api_keys import ApiKey, KeyRing, Role

PUBLIC_PATHS = frozenset({"/healthz", "/readyz"})
ROUTE_ROLES: Mapping[str, Role] = {
    "/v1/lookup": Role.READER,
    "/v1/explain": Role.READER,
    "/v1/blocks/fetch": Role.READER,
    "/v1/info": Role.READER,
    "/v1/blocks": Role.WRITER,
    "/v1/pin": Role.WRITER,
    "/v1/unpin": Role.WRITER,
    "/v1/pins": Role.READER,
    "/v1/stats": Role.ADMIN,
    "/v1/purge": Role.ADMIN,
    "/metrics": Role.ADMIN,
    "/openapi.json": Role.READER,
    "/docs": Role.READER,
    "/docs/oauth2-redirect": Role.READER,
    "/redoc": Role.READER,
    # The docs pages' own scripts, styles and icon (service/api/docs.py), as the pages.
    "/docs/swagger-ui-bundle.js": Role.READER,
    "/docs/swagger-ui.css": Role.READER,
    "/docs/favicon.png": Role.READER,
    "/redoc/redoc.standalone.js": Role.READER,
}
# With --auth none every request acts as this key: one tenant (""), every role.
ANONYMOUS = ApiKey(id="anonymous", tenant="", role=Role.ADMIN, sha256="")


def principal(request: Request) -> ApiKey:
    """The key the request was authenticated with (ANONYMOUS with --auth none)."""
    found: ApiKey = request.scope.get("state", {}).get("principal", ANONYMOUS)
    return found


class Authenticator:
    """ASGI middleware: 401 without a valid key, 403 without the route's role; the key is left
    in the request's state for the routes (its tenant picks the namespace)."""

    def __init__(self, app: ASGIApp, *, keys: KeyRing | None) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check one request's key before the application sees it."""
        if scope["type"] != "http" or self.keys is None or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        key = self._presented_key(scope)
        if key is None:
            detail = "send a valid API key as `Authorization: Bearer <key>`"
            await refuse(send, scope, Unauthorized(detail))
            return
        required = ROUTE_ROLES.get(scope["path"], Role.ADMIN)
        if key.role < required:
            detail = (f"key {key.id!r} has role {key.role.name.lower()}; "
                      f"{scope['path']} needs {required.name.lower()}")  # fmt: skip
            await refuse(send, scope, Forbidden(detail))
            return
        scope.setdefault("state", {})["principal"] = key
        await self.app(scope, receive, send)

    def _presented_key(self, scope: Scope) -> ApiKey | None:
        assert self.keys is not None
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() != "bearer" or not token.strip():
                    return None
                return self.keys.authenticate(token.strip())
        return None
