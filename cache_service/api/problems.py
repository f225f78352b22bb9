"""One place that turns every error into an RFC 9457 application/problem+json response."""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cache_service.api.bodies import validation_problem
from cache_service.errors import PROBLEM_BASE, PromptCacheError

PROBLEM_JSON = "application/problem+json"
log = logging.getLogger("cache_service.api")


def problem_response(error: PromptCacheError, request: Request) -> JSONResponse:
    """The problem+json response for a service error."""
    return JSONResponse(
        error.to_problem(instance=request.url.path),
        status_code=error.status,
        media_type=PROBLEM_JSON,
    )


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
    body = {
        "type": PROBLEM_BASE + "internal",
        "title": "Internal error",
        "status": 500,
        "detail": "the service failed unexpectedly; nothing was changed by this request",
        "instance": request.url.path,
    }
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
