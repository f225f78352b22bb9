"""GET /v1/local-reads: where a client on the service's own host reads payloads itself.

With --local-reads, the answer names the LMDB folder, the host's boot id, the hash seed, the
caller's tenant, the retention table and the block sizes: all a same-host client needs to run
the service's own verified read (`LmdbReader`) on the files while a lookup over HTTP counts
the hit and refreshes the blocks' use. Without it the route answers 404 naming the flag.
"""

from __future__ import annotations

import orjson
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from cache_service.core.errors import NotEnabled
from cache_service.core.same_host import boot_id
from cache_service.service.api.auth import principal
from cache_service.service.api.bodies import JSON
from cache_service.service.api.openapi import responses
from cache_service.service.api.state import service_state
from cache_service.wire.answers import LocalReadsResponse

router = APIRouter()


@router.get(
    "/v1/local-reads",
    summary="Where a client on this host reads payloads from the store's files",
    responses=responses({JSON: LocalReadsResponse}, 404),
)
async def local_reads(request: Request) -> Response:
    """The store's folder, host, seed, the caller's tenant and the retention table."""
    state = service_state(request)
    offer = state.local_reads
    if offer is None:
        raise NotEnabled("local reads are off: the service was not started with --local-reads")
    answer = LocalReadsResponse(
        path=offer.path,
        boot_id=boot_id(),
        seed=offer.seed,
        tenant=principal(request).tenant,
        retention=dict(offer.lifetimes.ttl_seconds),
        slack_seconds=offer.lifetimes.slack_seconds,
        default_block_size=state.cache.config.default_block_size,
        block_sizes=dict(state.cache.config.model_block_sizes),
    )
    return Response(orjson.dumps(answer), media_type=JSON)
