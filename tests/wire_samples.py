"""A /v1/info answer as a service sends it, for tests whose scripted service answers one."""

from __future__ import annotations

from typing import Any

import orjson

from cache_service.wire.reports import (
    InfoBlockSizes,
    InfoHashing,
    InfoLimits,
    InfoResponse,
    InfoRetention,
)


def sample_info(*, block_size: int = 64, models: dict[str, int] | None = None) -> InfoResponse:
    """The answer of a service with the default settings, but for its block sizes."""
    return InfoResponse(
        service="prompt-cache-service",
        version="0.1.0",
        hashing=InfoHashing(
            scheme="xxh3-128-chained",
            version=1,
            seed_fingerprint="2208c7d12c47e647",
            token_encoding="uint32-le",
            key_bytes=16,
        ),
        block_size=InfoBlockSizes(default=block_size, models=dict(models or {})),
        retention=InfoRetention(classes={"agent": 259200.0, "chat": 604800.0}, default="chat"),
        store="memory",
        capacity_bytes=10 * 2**30,
        limits=InfoLimits(
            max_body_size=512 * 2**20, max_blocks_per_request=8192, max_tokens_per_request=1 << 20
        ),
        frame_media_type="application/vnd.prompt-cache.frames",
    )


def info_body(*, block_size: int = 64, models: dict[str, int] | None = None) -> dict[str, Any]:
    """`sample_info` as the JSON object on the wire, to edit into answers of other shapes."""
    body: dict[str, Any] = orjson.loads(
        orjson.dumps(sample_info(block_size=block_size, models=models))
    )
    return body
