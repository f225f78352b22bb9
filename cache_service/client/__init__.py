"""CacheClient and AsyncCacheClient: the prompt cache's HTTP API over httpx.

The twins share everything but the I/O call (as httpx's BaseClient -> Client / AsyncClient):
a shared base (`client/base.py`) builds each request, parses its answer and keeps the
fail-open state; a twin only sends. Errors:

- a problem answer (any non-2xx) raises the `ServiceError` subclass of its problem type (see
  `cache_service.client.problems`, exported here): `UnknownRetentionProblem` for a 422
  unknown-retention, with `.field` ("retention"), `.reason`, `.problem`, `.status` and the
  whole `.problem_body`;
- a 2xx answer the client cannot parse raises `InvalidAnswer`, a `ServiceError(502, ...)`, as a
  gateway would;
- a transport error or timeout raises `ServiceUnavailable` (503);
- arguments the service would refuse are refused before anything is sent: `InvalidField` (not
  a ServiceError; `except InvalidField` takes the service's refusals of a field too) for token
  ids and keys, `TypeError` for payloads that are not bytes.

With `fail_open=True`, the data-path calls (lookup, get_blocks, store, put_prefix) turn
`ServiceUnavailable` and 5xx answers into misses and back off: after a failure they return
misses at once, without the network, for `backoff_initial_seconds`, doubling per consecutive
failure up to `backoff_max_seconds`; one success resets it. A 507 (store full) is a miss that
starts no backoff: the service is up. 4xx answers are the caller's bug and are always raised.
Failing open is never silent: each miss is counted by reason in `client.failures` (and in
`prompt_cache_client_fail_open_total{reason}` on a `metrics_registry` passed in), and logged
as a warning on the `cache_service.client` logger, at most one line per URL every 30 s,
naming the URL and the error. A base URL without http:// or https:// is refused at once
(ValueError), and `healthy()` (bool, never raises) is the check a worker makes at start-up.

`route` asks which engine holds the longest prefix of a prompt (POST /v1/route) and answers a
`RouteAnswer`: `instances` best first (an `InstanceHold` per engine and medium), `store` (the
cache's own share), `best`; it never fails open, as a router must know it had no answer.

`info` answers a `ServiceInfo` (GET /v1/info: hashing, block sizes, retention, limits;
`block_size_for(model)` the tokens per block the service cuts a model's prompts into), read and
checked as the other answers are; `stats` (an admin's call) returns the JSON object as sent.

`put_prefix` answers a `StoredBlocks`: an int, the blocks newly stored, whose `conflicts`
counts blocks another writer had stored first with different bytes (the cache keeps those),
and whose `as_sent` says whether the cache now holds every block sent with the bytes sent.

The blocking client talks plain http through `StdlibTransport` (http.client), which reads
MiB-sized answers in one call; `copy=False` on lookup and get_blocks returns payloads as
memoryviews into the answer, and `copy=True` (the default) reads each payload off the socket
into bytes of its own: either way a prefix's bytes are copied only off the socket. Stores send
their payloads as they are, without joining them into one body first.
"""

from cache_service.client.aio import AsyncCacheClient
from cache_service.client.answers import (
    Match,
    Payload,
    ServiceInfo,
    StoredBlocks,
    StoreResult,
    Usage,
)
from cache_service.client.base import Clock
from cache_service.client.failures import FailOpenCounts
from cache_service.client.problems import (
    BlockSizeMismatchProblem,
    DiskFullProblem,
    ForbiddenProblem,
    HeadersTooLargeProblem,
    InsufficientStorageProblem,
    InvalidFieldProblem,
    MalformedBodyProblem,
    MissingParentProblem,
    NotEnabledProblem,
    NotReadyProblem,
    NotStoredProblem,
    NotSupportedByStoreProblem,
    OverloadedProblem,
    PayloadTooLargeProblem,
    QuotaExceededProblem,
    RequestProblem,
    RequestTimeoutProblem,
    StorageFailureProblem,
    StorageProblem,
    ThrottledProblem,
    UnauthorizedProblem,
    UnknownInstanceProblem,
    UnknownRetentionProblem,
    UnsupportedMediaTypeProblem,
)
from cache_service.client.route_answer import InstanceHold, RouteAnswer, StoreHold
from cache_service.client.sync import CacheClient
from cache_service.core.errors import InvalidAnswer, InvalidField, ServiceError, ServiceUnavailable

__all__ = [
    "AsyncCacheClient",
    "BlockSizeMismatchProblem",
    "CacheClient",
    "Clock",
    "DiskFullProblem",
    "FailOpenCounts",
    "ForbiddenProblem",
    "HeadersTooLargeProblem",
    "InstanceHold",
    "InsufficientStorageProblem",
    "InvalidAnswer",
    "InvalidField",
    "InvalidFieldProblem",
    "MalformedBodyProblem",
    "Match",
    "MissingParentProblem",
    "NotEnabledProblem",
    "NotReadyProblem",
    "NotStoredProblem",
    "NotSupportedByStoreProblem",
    "OverloadedProblem",
    "Payload",
    "PayloadTooLargeProblem",
    "QuotaExceededProblem",
    "RequestProblem",
    "RequestTimeoutProblem",
    "RouteAnswer",
    "ServiceError",
    "ServiceInfo",
    "ServiceUnavailable",
    "StorageFailureProblem",
    "StorageProblem",
    "StoreHold",
    "StoreResult",
    "StoredBlocks",
    "ThrottledProblem",
    "UnauthorizedProblem",
    "UnknownInstanceProblem",
    "UnknownRetentionProblem",
    "UnsupportedMediaTypeProblem",
    "Usage",
]
