"""Every error the service raises, under one root.

The hierarchy::

    PromptCacheError                 root; carries an HTTP status and an RFC 9457 problem type
    ├── RequestError                 4xx: the caller's request is wrong; nothing was changed
    │   ├── MalformedBody            400  body is not valid JSON / not a valid frame stream
    │   ├── InvalidField             422  a field has a bad value (names the field)
    │   │   ├── BlockSizeMismatch    422  the request's block_size differs from the model's
    │   │   ├── UnknownRetention     422  a retention class that is not configured
    │   │   └── UnknownInstance      422  a route names an instance no engine is configured as
    │   ├── Unauthorized             401  no API key, or an unknown one
    │   ├── Forbidden                403  the key's role does not allow the route
    │   ├── QuotaExceeded            403  past the tenant's pin quota
    │   ├── RequestTimeout           408  the body did not arrive in time (slow client)
    │   ├── HeadersTooLarge          431  request line and headers over the limit
    │   ├── Throttled                429  a key's request or byte rate quota (Retry-After)
    │   │   └── Overloaded           503  writes backed up; reads still served (Retry-After)
    │   ├── PayloadTooLarge          413  body or block count over a configured limit
    │   ├── UnsupportedMediaType     415  wrong Content-Type
    │   ├── MissingParent            409  a stored block's parent is neither stored nor sent
    │   ├── NotStored                409  a prefix to pin is not (all) stored
    │   └── NotEnabled               404  a route the service was not started with (names the flag)
    ├── StorageError                 5xx: the store could not do what was asked
    │   ├── InsufficientStorage      507  full, and nothing can be evicted
    │   ├── StoreFull                (internal) the backend ran out of room mid-write; retried
    │   │   └── DiskFull             507  the file system is full (after eviction could not help)
    │   ├── StorageFailure           503  the disk failed a write (I/O error), or LMDB gave up
    │   ├── NotReady                 503  the service is starting or stopping (store not open)
    │   └── SettingsMismatch         (start-up) the store's data was made with other settings
    ├── NotSupportedByStore          501  the store's backend cannot do that (declared capability)
    └── ServiceError                 raised by the client: the service answered with a problem
        ├── ServiceUnavailable       the service could not be reached or timed out
        ├── InvalidAnswer            502  a 2xx answer the client cannot use (names the field)
        └── (a class per problem type: cache_service.client.problems)

A single exception handler on the root maps every error to a problem+json response.
"""

from __future__ import annotations

from typing import Any

PROBLEM_BASE = "https://prompt-cache.dev/problems/"
PROBLEM_JSON = "application/problem+json"


def internal_problem(instance: str, detail: str) -> dict[str, Any]:
    """The RFC 9457 body of an unexpected failure (500), saying no more than `detail`."""
    return {
        "type": PROBLEM_BASE + "internal",
        "title": "Internal error",
        "status": 500,
        "detail": detail,
        "instance": instance,
    }


class PromptCacheError(Exception):
    """Root of every error raised by the prompt cache service and its client."""

    status: int = 500
    problem: str = "internal"
    title: str = "Internal error"

    def __init__(self, detail: str, **extensions: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.extensions = extensions

    @property
    def problem_type(self) -> str:
        """The RFC 9457 `type` URI of this error."""
        return PROBLEM_BASE + self.problem

    def to_problem(self, instance: str | None = None) -> dict[str, Any]:
        """Render this error as an RFC 9457 problem details object."""
        body: dict[str, Any] = {
            "type": self.problem_type,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
        }
        if instance is not None:
            body["instance"] = instance
        body.update(self.extensions)
        return body


class RequestError(PromptCacheError):
    """The request is wrong; the store was not changed."""

    status = 400
    problem = "bad-request"
    title = "Bad request"


class MalformedBody(RequestError):
    """The body could not be parsed at all."""

    status = 400
    problem = "malformed-body"
    title = "Malformed request body"


class InvalidField(RequestError):
    """One or more fields have invalid values; `errors` names each field, `field` and `reason`
    the first."""

    status = 422
    problem = "invalid-field"
    title = "Invalid field"

    def __init__(self, field: str, message: str, **extensions: Any) -> None:
        errors = extensions.pop("errors", None) or [{"field": field, "message": message}]
        super().__init__(f"{field}: {message}", errors=errors, **extensions)
        self.field = field
        self.reason = message


class BlockSizeMismatch(InvalidField):
    """The block size a request expects is not the one the server uses for the model."""

    problem = "block-size-mismatch"
    title = "Block size mismatch"


class UnknownRetention(InvalidField):
    """The request names a retention class that is not configured."""

    problem = "unknown-retention"
    title = "Unknown retention class"


class UnknownInstance(InvalidField):
    """A request names an instance no engine of its model is configured as (422); which
    instances exist depends on the service's configuration, so no schema can state it."""

    problem = "unknown-instance"
    title = "Unknown instance"


class PayloadTooLarge(RequestError):
    """The body, or the number of blocks in it, is over a configured limit."""

    status = 413
    problem = "payload-too-large"
    title = "Payload too large"


class RequestTimeout(RequestError):
    """The body did not arrive within the configured time (a slow or stalled client)."""

    status = 408
    problem = "request-timeout"
    title = "Request timeout"


class HeadersTooLarge(RequestError):
    """The request line and headers are over the configured limit."""

    status = 431
    problem = "headers-too-large"
    title = "Request header fields too large"


class Throttled(RequestError):
    """A refusal the caller may retry later: `retry_after_seconds` says when."""

    status = 429
    problem = "rate-limited"
    title = "Too many requests"

    def __init__(self, detail: str, *, retry_after_seconds: float, **extensions: Any) -> None:
        super().__init__(detail, retry_after_seconds=retry_after_seconds, **extensions)
        self.retry_after_seconds = retry_after_seconds


class Overloaded(Throttled):
    """Writes are backed up; reads are still served."""

    status = 503
    problem = "writes-backed-up"
    title = "Writes backed up"


class QuotaExceeded(RequestError):
    """The request would take the tenant past a configured quota (pins, capacity)."""

    status = 403
    problem = "quota-exceeded"
    title = "Quota exceeded"


class Unauthorized(RequestError):
    """No API key, or one that is not configured."""

    status = 401
    problem = "unauthorized"
    title = "Unauthorized"


class Forbidden(RequestError):
    """The key's role does not allow this route."""

    status = 403
    problem = "forbidden"
    title = "Forbidden"


class UnsupportedMediaType(RequestError):
    """The Content-Type is not one this route accepts."""

    status = 415
    problem = "unsupported-media-type"
    title = "Unsupported media type"


class MissingParent(RequestError):
    """A block's parent is neither stored nor part of the same request: the field to change
    is start_block (lower, to send the parent too)."""

    status = 409
    problem = "missing-parent"
    title = "Parent block not stored"

    def __init__(self, detail: str, **extensions: Any) -> None:
        super().__init__(detail, field="start_block", **extensions)


class NotStored(RequestError):
    """An operation on a prefix (a pin) names blocks that are not stored."""

    status = 409
    problem = "not-stored"
    title = "Prefix not stored"


class NotEnabled(RequestError):
    """A route of a feature the operator did not turn on; the detail names the flag."""

    status = 404
    problem = "not-enabled"
    title = "Not enabled on this service"


class NotSupportedByStore(PromptCacheError):
    """The store this service runs on cannot do what was asked (a Redis store keeps no pins,
    for one); nothing was changed."""

    status = 501
    problem = "not-supported-by-store"
    title = "Not supported by this store"


class StorageError(PromptCacheError):
    """The store failed to do what was asked."""

    status = 500
    problem = "storage"
    title = "Storage error"


class InsufficientStorage(StorageError):
    """The store is full and nothing in it can be evicted."""

    status = 507
    problem = "insufficient-storage"
    title = "Insufficient storage"


class StoreFull(StorageError):
    """The backend ran out of room during a write; the caller evicts and retries."""

    status = 507
    problem = "insufficient-storage"
    title = "Insufficient storage"


class DiskFull(StoreFull):
    """The file system holding the store ran out of space (ENOSPC, or the I/O error of a
    commit that could not be written); reads go on, and room freed inside the store (by
    eviction or a purge) lets writes recover."""

    problem = "disk-full"
    title = "Disk full"


class StorageFailure(StorageError):
    """The store's disk failed a write for another reason than room (an I/O error), or the
    LMDB environment failed; nothing was stored, and reads go on where they can."""

    status = 503
    problem = "storage-failure"
    title = "Storage failure"


class NotReady(StorageError):
    """The service is starting or stopping; its store is not open."""

    status = 503
    problem = "not-ready"
    title = "Service not ready"


class SettingsMismatch(StorageError):
    """A store was opened with settings that define its data (seed, block size...) other
    than the ones it records; `extensions["settings"]` names them."""

    problem = "settings-mismatch"
    title = "Store made with other settings"


class ServiceError(PromptCacheError):
    """The service answered a client call with an error (problem details attached).

    `problem` names the type the service sent (`invalid-field`; a type of no service of ours,
    such as `about:blank`, as sent), `field` the request field it refused (None when the
    problem is not about one field) and `reason` what is wrong, without the field's name.
    The client raises a subclass per problem type (`cache_service.client.problems`).
    """

    field: str | None
    reason: str

    def __init__(self, status: int, problem_body: dict[str, Any]) -> None:
        detail = str(problem_body.get("detail") or problem_body.get("title") or status)
        extensions = {k: v for k, v in problem_body.items() if k not in _PROBLEM_MEMBERS}
        # Not super(): in the client's classes, each both a ServiceError and the service's own
        # error of that type, the next constructor in line is that error's, with other fields.
        PromptCacheError.__init__(self, detail, **extensions)
        self.status = status
        self.problem_body = problem_body
        self.title = str(problem_body.get("title", "Service error"))
        self.problem = self.problem_type.removeprefix(PROBLEM_BASE)
        self.field, self.reason = _field_and_reason(problem_body, detail)

    @property
    def problem_type(self) -> str:
        """The `type` URI the service sent."""
        return str(self.problem_body.get("type", "about:blank"))


_PROBLEM_MEMBERS = frozenset({"type", "title", "status", "detail", "instance"})


def _field_and_reason(problem_body: dict[str, Any], detail: str) -> tuple[str | None, str]:
    """The field a problem names (its first `errors` entry, or its `field` member) and what is
    wrong with it; (None, detail) for a problem about no one field."""
    errors = problem_body.get("errors")
    first = errors[0] if isinstance(errors, list) and errors else None
    if isinstance(first, dict) and isinstance(first.get("field"), str):
        return first["field"], str(first.get("message") or detail)
    field = problem_body.get("field")
    if isinstance(field, str):
        return field, detail.removeprefix(f"{field}: ")
    return None, detail


class ServiceUnavailable(ServiceError):
    """The service could not be reached, or did not answer in time."""

    def __init__(self, detail: str) -> None:
        super().__init__(503, {"title": "Service unavailable", "detail": detail})


class InvalidAnswer(ServiceError):
    """A 2xx answer the client cannot use (not JSON, or not the answer's declared shape): a
    502, as a gateway reports a bad upstream."""

    def __init__(self, detail: str) -> None:
        super().__init__(
            502,
            {
                "type": "about:blank",
                "title": "Invalid answer from the service",
                "status": 502,
                "detail": detail,
            },
        )
