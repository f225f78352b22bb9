"""Request bodies and the other answers of the HTTP API (pydantic models; also the OpenAPI
schema). The answers the Python client reads are declared in `cache_service.wire.answers`."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from cache_service.core.operators import EXPLANATIONS
from cache_service.core.tokens import MAX_TOKEN_ID

Token = Annotated[int, Field(strict=True, ge=0, le=MAX_TOKEN_ID)]
HexKey = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$", description="32 lowercase hex chars")]
Name = Annotated[str, Field(max_length=256)]


class NamespaceFields(BaseModel):
    """The fields that pick a namespace (with the tenant, which comes from authentication)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: Annotated[str, Field(min_length=1, max_length=256, description="Model name.")]
    kv_layout: Name = Field("", description="Free string naming the KV layout (dtype, TP rank…).")
    salt: Name = Field("", description="Cache salt; requests with different salts never share.")


# Rules that depend on the service's configuration, so no static schema can state them: they
# are described here, and refused with a 422 of their own problem type (see openapi.py).
RETENTION_DOC = (
    "Retention class: one this service configures (GET /v1/info, retention.classes), else 422 "
    "unknown-retention; the default class if omitted."
)
BLOCK_SIZE_DOC = (
    "The block size the caller expects: if the service cuts this model into blocks of another "
    "size (GET /v1/info, block_size), 422 block-size-mismatch. Omit it to take the service's."
)
# Bounded as token ids are, though no service cuts blocks nearly this long: a number of any
# size is then refused by the schema, whose message repeats no input, and never read further.
BlockSize = Annotated[int, Field(ge=1, le=MAX_TOKEN_ID, description=BLOCK_SIZE_DOC)]


class PromptOptions(NamespaceFields):
    """How to cache a prompt."""

    retention: Name | None = Field(None, description=RETENTION_DOC)
    block_size: BlockSize | None = Field(None, description=BLOCK_SIZE_DOC)


TOKENS_DOC = "Token ids, unsigned 32-bit integers."
PREFIX_TOKENS_DOC = (
    "A prefix's token ids, unsigned 32-bit integers: its full blocks count, so at least one "
    "block's worth (block_size, GET /v1/info), else 422."
)
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


class ExplainHeader(LookupHeader):
    """The JSON header of a POST /v1/explain frame body."""

    tenant: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")] | None = Field(
        None, description="Whose blocks: an admin key may name any tenant; others only theirs."
    )


class ExplainRequest(LookupRequest, ExplainHeader):
    """POST /v1/explain as JSON: a lookup's body (an admin may name a tenant)."""


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


TenantName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
TENANT_DOC = "Whose blocks: an admin key may name any tenant; other keys only their own."


# A rule of two fields, stated in the schema as well as checked by the route: exactly one of
# `tokens` and `keys` is given (an array; null counts as not given).
EXACTLY_ONE_OF_TOKENS_AND_KEYS: dict[str, Any] = {
    "oneOf": [
        {"required": ["tokens"], "properties": {"tokens": {"type": "array"}}},
        {"required": ["keys"], "properties": {"keys": {"type": "array"}}},
    ]
}


class PinRequest(NamespaceFields):
    """POST /v1/pin and /v1/unpin: a prefix by its tokens (every full block) or its keys."""

    model_config = ConfigDict(json_schema_extra=EXACTLY_ONE_OF_TOKENS_AND_KEYS)

    tokens: Annotated[list[Token], Field(min_length=1)] | None = Field(
        None, description=PREFIX_TOKENS_DOC
    )
    keys: Annotated[list[HexKey], Field(min_length=1)] | None = Field(
        None, description="The prefix's keys, from block 0."
    )
    block_size: BlockSize | None = Field(None, description=BLOCK_SIZE_DOC)
    tenant: TenantName | None = Field(None, description=TENANT_DOC)


class PinResponse(BaseModel):
    """What a pin did."""

    model: str
    key: str = Field(description="The pinned prefix's deepest key.")
    pinned_blocks: int
    new: bool = Field(description="False when this prefix was already pinned.")


class UnpinResponse(BaseModel):
    """What an unpin did."""

    model: str
    released_blocks: int = Field(description="Blocks the pin held; 0 if there was no such pin.")


# A purge by namespace or prefix names its model: kv_layout, salt and tokens (each null if
# given) only with a model. Stated in the schema as well as checked by the route.
MODEL_FOR_NAMESPACE_OR_PREFIX: dict[str, Any] = {
    "anyOf": [
        {"required": ["model"], "properties": {"model": {"type": "string"}}},
        {"properties": {name: {"type": "null"} for name in ("kv_layout", "salt", "tokens")}},
    ]
}


class PurgeRequest(BaseModel):
    """POST /v1/purge: a tenant; one of its namespaces (model, kv_layout, salt); or, with
    tokens, that prompt's last full block and every block stored under it."""

    model_config = ConfigDict(
        extra="forbid", strict=True, json_schema_extra=MODEL_FOR_NAMESPACE_OR_PREFIX
    )

    tenant: TenantName | None = Field(None, description=TENANT_DOC)
    model: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    kv_layout: Name | None = None
    salt: Name | None = None
    tokens: Annotated[list[Token], Field(min_length=1)] | None = Field(
        None, description=PREFIX_TOKENS_DOC
    )
    block_size: BlockSize | None = Field(None, description=BLOCK_SIZE_DOC)


class PurgeResponse(BaseModel):
    """What a purge removed."""

    tenant: str
    blocks: int
    bytes: int = Field(description="Payload bytes removed.")
    pins: int = Field(description="Pins removed with their blocks.")


class ExplainResponse(BaseModel):
    """Why a lookup stops where it does."""

    model: str
    block_size: int
    prompt_tokens: int
    matched_blocks: int
    cached_tokens: int
    first_unmatched_block: int | None
    reason: str = Field(description=", ".join(EXPLANATIONS) + ": `detail` says what each means.")
    detail: str
    facts: dict[str, str | int | float | None] = Field(
        description="When and under which class (removed_at, expired_at, retention), or "
        "where the block is stored instead (model, kv_layout, salt, block_size)."
    )


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
    PinRequest,
    PurgeRequest,
    ExplainRequest,
    ExplainHeader,
)
