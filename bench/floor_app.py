"""The framework floor: a bare lookup endpoint in the same framework and server as ours.

It reads the same request body (a frame body whose one frame holds uint32 little-endian
tokens), parses its header with the same pydantic model, checks the tokens frame, and answers
a constant JSON object: everything a lookup costs except hashing, the store and the answer.
"""

from __future__ import annotations

import argparse

import uvicorn
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cache_service.core.framing import MEDIA_TYPE, decode_frames
from cache_service.service.api.bodies import (
    parse_object,
    read_body,
    require_media_type,
    tokens_frame,
)
from cache_service.service.api.schemas import LookupHeader

CONSTANT = {
    "model": "floor",
    "block_size": 64,
    "prompt_tokens": 0,
    "matched_blocks": 0,
    "cached_tokens": 0,
    "keys": [],
    "retention": "chat",
    "usage": {"prompt_cache_hit_tokens": 0, "prompt_cache_miss_tokens": 0},
}


def create_floor_app() -> FastAPI:
    """The floor application."""
    app = FastAPI()

    @app.post("/v1/lookup")
    async def lookup(request: Request) -> Response:
        require_media_type(request, MEDIA_TYPE)
        raw = await read_body(request, limit_bytes=512 * 2**20, timeout_seconds=30.0)
        header, frames = decode_frames(raw)
        parse_object(LookupHeader, header)
        tokens_frame(frames[0], "frames[0]")
        return JSONResponse(CONSTANT)

    return app


def main() -> None:
    """Serve the floor on 127.0.0.1."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(create_floor_app(), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
