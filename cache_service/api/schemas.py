"""Request and response bodies of the HTTP API (pydantic models; also the OpenAPI schema)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from cache_service.blocks import MAX_TOKEN_ID

Token = Annotated[int, Field(strict=True, ge=0, le=MAX_TOKEN_ID)]
HexKey = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$", description="32 lowercase hex chars")]
Name = Annotated[str, Field(max_length=256)]


class NamespaceFields(BaseModel):
    """The fields that pick a namespace (with the tenant, which comes from authentication)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: Annotated[str, Field(min_length=1, max_length=256, description="Model name.")]
    kv_layout: Name = Field("", description="Free string naming the KV layout (dtype, TP rank…).")
    salt: Name = Field("", description="Cache salt; requests with different salts never share.")


class PromptOptions(NamespaceFields):
    """How to cache a prompt."""

    retention: Name | None = Field(None, description="Retention class; the default if omitted.")
    block_size: Annotated[int, Field(ge=1)] | None = Field(
        None, description="The block size the caller expects; 422 if the service's differs."
    )


TOKENS_DOC = "Token ids, unsigned 32-bit integers."
TOKENS_FRAME_DOC = (
    "Token ids; omit them to send the tokens as the first frame instead, as uint32 "
    "little-endian (4 bytes a token): no JSON to encode or parse."
)


class LookupHeader(PromptOptions):
    """The JSON header of a POST /v1/lookup frame body; its one frame holds the tokens."""

    fetch: bool = Field(False, description="Also return the matched blocks' payloads (frames).")


class LookupRequest(LookupHeader):
    """POST /v1/lookup as JSON."""

    tokens: list[Token] = Field(description=TOKENS_DOC)


class StoreHeader(PromptOptions):
    """The JSON header of a POST /v1/blocks frame body: frames are the tokens (if not given
    here), then one payload per block stored."""

    tokens: list[Token] | None = Field(None, description=TOKENS_FRAME_DOC)
    start_block: Annotated[int, Field(ge=0)] = Field(
        0, description="Index of the first block whose payload is sent."
    )


class FetchRequest(NamespaceFields):
    """POST /v1/blocks/fetch."""

    keys: list[HexKey] = Field(description="Block keys, as lookup returned them.")


class Usage(BaseModel):
    """Per-request token accounting, as OpenAI-style APIs report prompt caching."""

    prompt_cache_hit_tokens: int
    prompt_cache_miss_tokens: int


class LookupResponse(BaseModel):
    """The longest cached prefix; with fetch, the header of a frame body."""

    model: str
    block_size: int
    prompt_tokens: int
    matched_blocks: int
    cached_tokens: int
    keys: list[str]
    retention: str
    usage: Usage


class StoreResponse(BaseModel):
    """What a store request did."""

    model: str
    block_size: int
    start_block: int
    requested_blocks: int
    stored_blocks: int = Field(description="Blocks newly stored (and still held).")
    refreshed_blocks: int = Field(
        description="Blocks already stored; refreshed, kept as first written."
    )
    conflicts: int = Field(
        description="Refreshed blocks whose bytes differed from the stored ones."
    )
    truncated_blocks: int = Field(description="Blocks not stored: the request exceeds the cache.")
    collisions: int = Field(description="Blocks refused: another block holds their key.")
    keys: list[str] = Field(description="Keys of the blocks sent, in order.")


class FetchHeader(BaseModel):
    """The header of a fetch answer; one frame per requested key (absent = gone)."""

    model: str
    requested: int
    found: int


class ProblemField(BaseModel):
    """One invalid field."""

    field: str
    message: str


class Problem(BaseModel):
    """RFC 9457 problem details."""

    type: str
    title: str
    status: int
    detail: str
    instance: str | None = None
    errors: list[ProblemField] | None = None


REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    LookupRequest,
    LookupHeader,
    StoreHeader,
    FetchRequest,
)
