"""GET /v1/local-reads: where a client on the service's own host reads payloads itself.

With --local-reads, the answer names the LMDB folder, the host's boot id, the hash seed, the
caller's tenant, the retention table and the block sizes: all a same-host client needs to run
the service's own verified read (`LmdbReader`) on the files while a lookup over HTTP counts
the hit and refreshes the blocks' use. Without it the route answers 404 naming the flag.

It answers only over loopback: a client that may use the answer runs on this host, and the
seed and the folder are nothing to tell a caller elsewhere (403 for one that is not).
"""

from __future__ import annotations

import ipaddress

import orjson
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from cache_service.core.errors import Forbidden, NotEnabled
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
    responses=responses({JSON: LocalReadsResponse}, 403, 404),
)
async def local_reads(request: Request) -> Response:
    """The store's folder, host, seed, the caller's tenant and the retention table."""
    state = service_state(request)
    offer = state.local_reads
    if offer is None:
        raise NotEnabled("local reads are off: the service was not started with --local-reads")
    if not _on_loopback(request):
        raise Forbidden(
            "local reads are answered over loopback only: connect to 127.0.0.1 (or ::1) "
            "from this host"
        )
    answer = LocalReadsResponse(
        path=offer.path,
        store_id=offer.store_id,
        boot_id=boot_id(),
        seed=offer.seed,
        tenant=principal(request).tenant,
        retention=dict(offer.lifetimes.ttl_seconds),
        slack_seconds=offer.lifetimes.slack_seconds,
        default_block_size=state.cache.config.default_block_size,
        block_sizes=dict(state.cache.config.model_block_sizes),
    )
    return Response(orjson.dumps(answer), media_type=JSON)


def _on_loopback(request: Request) -> bool:
    """Whether the caller came over a loopback address (a Unix socket has no address: yes)."""
    if request.client is None or not request.client.host:
        return True
    try:
        return ipaddress.ip_address(request.client.host).is_loopback
    except ValueError:  # not an address (a name): nothing shows where it is
        return False
