"""The client's problem classes without a server: the tree mirrors the service's errors, and
the answers no test can make a real service send (an unexpected failure, a bare storage
error, a proxy's page, a newer service's type) still raise a class that says what happened.
tests/integration/test_client_problems.py provokes every other type from a real service."""

from __future__ import annotations

import asyncio
import inspect

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response

import cache_service.client
from cache_service.client.problems import (
    PROBLEM_CLASSES,
    BlockSizeMismatchProblem,
    RequestProblem,
    StorageProblem,
    problem_error,
    response_error,
)
from cache_service.core import errors
from cache_service.core.errors import PROBLEM_BASE, PromptCacheError, ServiceError, StorageError
from cache_service.service.api import problems

# Service errors no answer carries: raised inside the store and retried (StoreFull), or only
# while a store opens, when start-up fails with the reason (SettingsMismatch).
NEVER_SENT = {errors.StoreFull, errors.SettingsMismatch}
CLIENT_SIDE = {errors.ServiceError, errors.ServiceUnavailable, errors.InvalidAnswer}


def answered(response: Response) -> httpx.Response:
    """A Starlette response of the service's, as the client receives it."""
    return httpx.Response(
        response.status_code, headers=response.headers.items(), content=response.body
    )


def request_for(path: str) -> Request:
    """A request as the service's handlers see it."""
    return Request(
        {"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""}
    )


def service_errors() -> list[type[PromptCacheError]]:
    """Every error class of the service that has a problem type of its own."""
    found = [
        value
        for value in vars(errors).values()
        if inspect.isclass(value) and issubclass(value, PromptCacheError)
    ]
    return [cls for cls in found if cls not in NEVER_SENT | CLIENT_SIDE | {PromptCacheError}]


def test_every_service_error_has_a_client_class_that_is_both() -> None:
    for service_class in service_errors():
        client_class = PROBLEM_CLASSES[service_class.problem]
        assert issubclass(client_class, ServiceError), client_class
        assert issubclass(client_class, service_class), client_class
        assert client_class.__name__ == service_class.__name__.removesuffix("Error") + "Problem"
        assert client_class.__name__ in cache_service.client.__all__
    assert len(PROBLEM_CLASSES) == len(service_errors())


def test_an_unexpected_failure_is_a_500_service_error_named_internal() -> None:
    rendered = asyncio.run(problems._on_unexpected(request_for("/v1/lookup"), RuntimeError("x")))
    error = response_error(answered(rendered))
    assert type(error) is ServiceError
    assert (error.status, error.problem, error.field) == (500, "internal", None)
    assert error.reason == "the service failed unexpectedly; nothing was changed by this request"


def test_a_bare_storage_error_is_a_storage_problem() -> None:
    failure = StorageError("the store could not be read")
    rendered = problems.problem_response(failure, request_for("/v1/lookup"))
    error = response_error(answered(rendered))
    assert type(error) is StorageProblem and isinstance(error, StorageError)
    assert (error.status, error.problem, error.reason) == (500, "storage", failure.detail)


@pytest.mark.parametrize("status", [400, 404, 409, 422, 429, 499])
def test_a_4xx_is_never_internal_whatever_its_body(status: int) -> None:
    page = httpx.Response(
        status, text="<h1>refused by a proxy</h1>", headers={"content-type": "text/html"}
    )
    newer = httpx.Response(status, json={"type": PROBLEM_BASE + "from-the-future", "detail": "new"})
    for answer in (page, newer):
        error = response_error(answer)
        assert type(error) is RequestProblem
        assert error.problem != "internal"
    assert response_error(page).problem == "about:blank"
    assert response_error(page).reason == "<h1>refused by a proxy</h1>"
    assert response_error(newer).problem == "from-the-future"
    assert ServiceError(status, {"detail": "as callers built it"}).problem != "internal"


def test_a_5xx_of_a_type_the_client_does_not_know_is_a_service_error() -> None:
    error = problem_error(502, {"type": "about:blank", "title": "Bad Gateway", "status": 502})
    assert type(error) is ServiceError
    assert (error.problem, error.reason) == ("about:blank", "Bad Gateway")


def test_a_problem_keeps_its_body_and_its_extensions() -> None:
    body = {
        "type": PROBLEM_BASE + "block-size-mismatch",
        "title": "Block size mismatch",
        "status": 422,
        "detail": "block_size: the service cuts model 'm' into blocks of 64 tokens, not 32",
        "instance": "/v1/lookup",
        "errors": [{"field": "block_size", "message": "blocks of 64 tokens, not 32"}],
        "expected": 64,
    }
    error = problem_error(422, body)
    assert isinstance(error, BlockSizeMismatchProblem)
    assert error.problem_body is body
    assert error.extensions == {"errors": body["errors"], "expected": 64}
    assert error.expected_block_size == 64
    assert (error.field, error.reason) == ("block_size", "blocks of 64 tokens, not 32")
