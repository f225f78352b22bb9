"""The exception a problem answer raises: a class for each problem type the service sends.

Each class is a `ServiceError` (`status`, `problem`, `field`, `reason`, `problem_body`) and
also the service's own error of that type (`cache_service.core.errors`), so the service's
names catch what it answered: `except InvalidField` takes a field the service refused as well
as one the client refused before sending (those are not ServiceErrors: nothing was sent).

The tree, with each class's status and problem type (under https://prompt-cache.dev/problems/):

    ServiceError                             any problem answer; `internal` (500) itself
    ├── ServiceUnavailable              -    no answer: not reached, or timed out
    ├── InvalidAnswer                   502  a 2xx answer the client cannot use
    ├── RequestProblem                  4xx  bad-request (not HTTP/1.1), or a 4xx of a type
    │   │                                    this client does not know (about:blank: no such
    │   │                                    route or method)
    │   ├── MalformedBodyProblem        400  malformed-body: not JSON, or not a frame stream
    │   ├── InvalidFieldProblem         422  invalid-field: the first field refused, and why
    │   │   ├── BlockSizeMismatchProblem 422 block-size-mismatch (`expected_block_size`)
    │   │   ├── UnknownRetentionProblem  422 unknown-retention
    │   │   └── UnknownInstanceProblem   422 unknown-instance
    │   ├── UnauthorizedProblem         401  unauthorized: no API key, or an unknown one
    │   ├── ForbiddenProblem            403  forbidden: the key's role does not allow it
    │   ├── QuotaExceededProblem        403  quota-exceeded: past the tenant's pin quota
    │   ├── NotEnabledProblem           404  not-enabled: the detail names the flag
    │   ├── RequestTimeoutProblem       408  request-timeout: the body came too slowly
    │   ├── MissingParentProblem        409  missing-parent: store the blocks before it first
    │   ├── NotStoredProblem            409  not-stored: a prefix to pin is not all stored
    │   ├── PayloadTooLargeProblem      413  payload-too-large: `field` when one is over
    │   ├── UnsupportedMediaTypeProblem 415  unsupported-media-type
    │   ├── HeadersTooLargeProblem      431  headers-too-large
    │   └── ThrottledProblem            429  rate-limited (`retry_after_seconds`)
    │       └── OverloadedProblem       503  writes-backed-up; reads still served
    ├── NotSupportedByStoreProblem      501  not-supported-by-store
    └── StorageProblem                  500  storage
        ├── InsufficientStorageProblem  507  insufficient-storage: full, nothing evictable
        ├── DiskFullProblem             507  disk-full: the file system is full
        ├── StorageFailureProblem       503  storage-failure: the disk failed a write
        └── NotReadyProblem             503  not-ready: the service is starting or stopping
"""

from __future__ import annotations

from typing import Any

import httpx

from cache_service.core import errors
from cache_service.core.errors import PROBLEM_BASE, ServiceError

MAX_ERROR_TEXT_CHARS = 2000  # a non-JSON error body (an HTML page from a proxy) is cut here


class RequestProblem(ServiceError, errors.RequestError):
    """A 4xx: the service refused the request as sent, and changed nothing."""


class MalformedBodyProblem(RequestProblem, errors.MalformedBody):
    """400 malformed-body: the body is not JSON, or not a frame stream."""


class InvalidFieldProblem(RequestProblem, errors.InvalidField):
    """422 invalid-field: `field` is the first field refused and `reason` why;
    `extensions["errors"]` lists each one refused as {"field", "message"}."""

    field: str

    def __init__(self, status: int, problem_body: dict[str, Any]) -> None:
        super().__init__(status, problem_body)
        self.field = self.field or "body"  # the service names each field; none named: the body


class BlockSizeMismatchProblem(InvalidFieldProblem, errors.BlockSizeMismatch):
    """422 block-size-mismatch: the request's block_size is not the one the service cuts the
    model into."""

    @property
    def expected_block_size(self) -> int | None:
        """The block size the service uses for the model, as it said."""
        expected = self.problem_body.get("expected")
        return expected if isinstance(expected, int) else None


class UnknownRetentionProblem(InvalidFieldProblem, errors.UnknownRetention):
    """422 unknown-retention: a retention class the service does not configure."""


class UnknownInstanceProblem(InvalidFieldProblem, errors.UnknownInstance):
    """422 unknown-instance: a route names an instance no engine of the model is."""


class UnauthorizedProblem(RequestProblem, errors.Unauthorized):
    """401 unauthorized: no API key, or one the service does not know."""


class ForbiddenProblem(RequestProblem, errors.Forbidden):
    """403 forbidden: the key's role does not allow the route, or names another tenant."""


class QuotaExceededProblem(RequestProblem, errors.QuotaExceeded):
    """403 quota-exceeded: the request would take the tenant past a quota."""


class NotEnabledProblem(RequestProblem, errors.NotEnabled):
    """404 not-enabled: a route of a feature the service was not started with."""


class RequestTimeoutProblem(RequestProblem, errors.RequestTimeout):
    """408 request-timeout: the body did not arrive within the service's body_timeout."""


class MissingParentProblem(RequestProblem, errors.MissingParent):
    """409 missing-parent: a block's parent is neither stored nor sent with it."""


class NotStoredProblem(RequestProblem, errors.NotStored):
    """409 not-stored: a prefix to pin is not (all) stored."""


class PayloadTooLargeProblem(RequestProblem, errors.PayloadTooLarge):
    """413 payload-too-large: the body, its tokens or its blocks are over a limit (`field`
    names the one over, when it is one field; `extensions["limit"]` the setting)."""


class UnsupportedMediaTypeProblem(RequestProblem, errors.UnsupportedMediaType):
    """415 unsupported-media-type: the route does not take that Content-Type."""


class HeadersTooLargeProblem(RequestProblem, errors.HeadersTooLarge):
    """431 headers-too-large: the request line and headers are over max_header_bytes."""


class ThrottledProblem(RequestProblem, errors.Throttled):
    """429 rate-limited: a key's rate quota is spent; retry after `retry_after_seconds`."""

    def __init__(self, status: int, problem_body: dict[str, Any]) -> None:
        super().__init__(status, problem_body)
        seconds = problem_body.get("retry_after_seconds")
        # The service always says; 1 s is the least its Retry-After header ever asks.
        self.retry_after_seconds = float(seconds) if isinstance(seconds, int | float) else 1.0


class OverloadedProblem(ThrottledProblem, errors.Overloaded):
    """503 writes-backed-up: too many stores wait for the store; lookups are still served."""


class NotSupportedByStoreProblem(ServiceError, errors.NotSupportedByStore):
    """501 not-supported-by-store: the service's store backend cannot do that."""


class StorageProblem(ServiceError, errors.StorageError):
    """5xx: the service's store could not do what was asked."""


class InsufficientStorageProblem(StorageProblem, errors.InsufficientStorage):
    """507 insufficient-storage: the store is full and nothing in it can be evicted."""


class DiskFullProblem(StorageProblem, errors.DiskFull):
    """507 disk-full: the file system under the store is full."""


class StorageFailureProblem(StorageProblem, errors.StorageFailure):
    """503 storage-failure: the store's disk failed a write, or its backend failed."""


class NotReadyProblem(StorageProblem, errors.NotReady):
    """503 not-ready: the service is starting or stopping; retry."""


PROBLEM_CLASSES: dict[str, type[ServiceError]] = {
    problem.problem: problem
    for problem in (
        RequestProblem,
        MalformedBodyProblem,
        InvalidFieldProblem,
        BlockSizeMismatchProblem,
        UnknownRetentionProblem,
        UnknownInstanceProblem,
        UnauthorizedProblem,
        ForbiddenProblem,
        QuotaExceededProblem,
        NotEnabledProblem,
        RequestTimeoutProblem,
        MissingParentProblem,
        NotStoredProblem,
        PayloadTooLargeProblem,
        UnsupportedMediaTypeProblem,
        HeadersTooLargeProblem,
        ThrottledProblem,
        OverloadedProblem,
        NotSupportedByStoreProblem,
        StorageProblem,
        InsufficientStorageProblem,
        DiskFullProblem,
        StorageFailureProblem,
        NotReadyProblem,
    )
}
"""The class of each problem type, by its name under PROBLEM_BASE."""


def problem_error(status: int, problem_body: dict[str, Any]) -> ServiceError:
    """The exception of a problem answer: its type's class, else RequestProblem for a 4xx and
    ServiceError for the rest."""
    sent = str(problem_body.get("type", ""))
    name = sent.removeprefix(PROBLEM_BASE) if sent.startswith(PROBLEM_BASE) else ""
    fallback = RequestProblem if 400 <= status < 500 else ServiceError
    return PROBLEM_CLASSES.get(name, fallback)(status, problem_body)


def response_error(response: httpx.Response) -> ServiceError:
    """The exception of a non-2xx answer: its problem+json, or its text as the detail."""
    body: Any = None
    if "json" in response.headers.get("content-type", ""):
        try:
            body = response.json()
        except ValueError:
            body = None
    if not isinstance(body, dict):
        body = {
            "type": "about:blank",
            "title": response.reason_phrase or "Error",
            "status": response.status_code,
            "detail": response.text[:MAX_ERROR_TEXT_CHARS],
        }
    return problem_error(response.status_code, body)
