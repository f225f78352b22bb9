"""One place that turns every error into an RFC 9457 application/problem+json response."""

from __future__ import annotations

import logging
import math
from http import HTTPStatus

import orjson
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Scope, Send

from cache_service.core.errors import (
    PROBLEM_JSON,
    PromptCacheError,
    RequestTimeout,
    Throttled,
    internal_problem,
)
from cache_service.service.api.bodies import validation_problem

log = logging.getLogger("cache_service.service.api")


def problem_response(error: PromptCacheError, request: Request) -> JSONResponse:
    """The problem+json response for a service error (with Retry-After when it says when)."""
    return JSONResponse(
        error.to_problem(instance=request.url.path),
        status_code=error.status,
        media_type=PROBLEM_JSON,
        headers=_headers(error),
    )


def _headers(error: PromptCacheError) -> dict[str, str] | None:
    if isinstance(error, RequestTimeout):  # the rest of the body is not waited for
        return {"Connection": "close"}
    return retry_after(error)


async def refuse(send: Send, scope: Scope, error: PromptCacheError) -> None:
    """Answer a request with a problem from ASGI middleware, before the app sees it. The
    body is not read: a refused request costs nothing to parse."""
    body = orjson.dumps(error.to_problem(instance=scope["path"]))
    headers = [(b"content-type", PROBLEM_JSON.encode()),
               (b"content-length", str(len(body)).encode())]  # fmt: skip
    if error.status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="prompt-cache"'))
    for name, value in (retry_after(error) or {}).items():
        headers.append((name.lower().encode(), value.encode()))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def retry_after(error: PromptCacheError) -> dict[str, str] | None:
    """The Retry-After header of a refusal that may be retried, in whole seconds."""
    if isinstance(error, Throttled):
        return {"Retry-After": str(max(1, math.ceil(error.retry_after_seconds)))}
    seconds = error.extensions.get("retry_after_seconds")  # a store's 503 that says when
    if isinstance(seconds, int | float):
        return {"Retry-After": str(max(1, math.ceil(seconds)))}
    return None


async def _on_service_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, PromptCacheError)
    return problem_response(exc, request)


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return problem_response(validation_problem(list(exc.errors())), request)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    body = {
        "type": "about:blank",
        "title": _reason(exc.status_code),
        "status": exc.status_code,
        "detail": str(exc.detail),
        "instance": request.url.path,
    }
    return JSONResponse(
        body, status_code=exc.status_code, media_type=PROBLEM_JSON, headers=exc.headers
    )


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s", request.url.path)
    detail = "the service failed unexpectedly; nothing was changed by this request"
    body = internal_problem(request.url.path, detail)
    return JSONResponse(body, status_code=500, media_type=PROBLEM_JSON)


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def install_problem_handlers(app: FastAPI) -> None:
    """Register the handlers: the root service error, validation, HTTP errors, the rest."""
    app.add_exception_handler(PromptCacheError, _on_service_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
