"""Authentication: every request but the health checks carries an API key with a role.

An ASGI middleware, so that every route, including the thin hot paths and any route added
later, is covered by one check; a route not listed in `ROUTE_ROLES` needs an admin key.

A key comes as `Authorization: Bearer <key>`, or, for a browser (which cannot be made to
send a bearer token), as HTTP Basic credentials whose password is the key (the user name is
not read). Only the pages meant for a browser (`BROWSER_PATHS`) add a Basic challenge to
their 401, so that the browser asks for the key once; the API's 401s are unchanged.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cache_service.core.errors import Forbidden, Unauthorized
from cache_service.service.api.problems import refuse
from cache_service.service.api_keys import ApiKey, KeyRing, Role

PUBLIC_PATHS = frozenset({"/healthz", "/readyz"})
# Pages a person opens in a browser: their 401 also asks for Basic credentials.
BROWSER_PATHS = frozenset({"/"})
BASIC_CHALLENGE = (b"www-authenticate", b'Basic realm="prompt-cache-service", charset="UTF-8"')
ROUTE_ROLES: Mapping[str, Role] = {
    "/": Role.ADMIN,  # the status page: every tenant's figures, as /v1/stats
    "/v1/lookup": Role.READER,
    "/v1/explain": Role.READER,
    "/v1/route": Role.READER,
    "/v1/blocks/fetch": Role.READER,
    "/v1/info": Role.READER,
    "/v1/local-reads": Role.READER,
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


# Methods that take a key as HTTP Basic credentials: reads only (see _presented_key).
BASIC_METHODS = frozenset({"GET", "HEAD"})


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
            if scope["method"] not in BASIC_METHODS:
                detail += " (HTTP Basic credentials are taken by GET and HEAD requests only)"
            if scope["path"] in BROWSER_PATHS:
                detail += " (or, from a browser, as the password of HTTP Basic credentials)"
                send = _with_basic_challenge(send)
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
                token = token.strip()
                if scheme.lower() == "basic":
                    # A browser resends remembered Basic credentials on any request to this
                    # origin, even one another site's page makes it send: only reads take
                    # them, so no forged form can store, pin or purge (cross-site requests).
                    if scope["method"] not in BASIC_METHODS:
                        return None
                    token = basic_password(token) or ""
                elif scheme.lower() != "bearer":
                    return None
                return self.keys.authenticate(token) if token else None
        return None


def basic_password(credentials: str) -> str | None:
    """The password of HTTP Basic credentials (base64 of `user:password`), or None if they
    are not such."""
    try:
        decoded = base64.b64decode(credentials, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    _user, colon, password = decoded.partition(":")
    return password if colon else None


def _with_basic_challenge(send: Send) -> Send:
    """`send`, adding a Basic challenge after the Bearer one to the answer's headers (a
    header line each: browsers read one challenge a line)."""

    async def challenging(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message["headers"], BASIC_CHALLENGE]}
        await send(message)

    return challenging
