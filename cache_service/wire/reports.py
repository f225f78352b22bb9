"""The service's reports on itself: GET /v1/info (what a worker must agree with) and GET
/v1/stats (what the store holds, and the hits and misses so far).

Declared as `answers.py` declares the data path's answers: frozen dataclasses whose fields are
the JSON object's, in the order the service writes them; the OpenAPI document's components
are generated from them and the client reads them with `reader.py`. Keyword-only: a report is
mostly counts, which a positional call would swap without a word.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class InfoHashing:
    """How block keys are made; a worker that hashes otherwise never hits."""

    scheme: str
    version: int
    seed_fingerprint: str = field(
        metadata={"description": "A fingerprint of the hash seed (the seed itself is secret)."}
    )
    token_encoding: str = field(metadata={"description": "How token ids are hashed as bytes."})
    key_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class InfoBlockSizes:
    """Tokens per block: the default, and the models configured otherwise."""

    default: int
    models: dict[str, int]


@dataclass(frozen=True, slots=True, kw_only=True)
class InfoRetention:
    """The retention classes and the one a request that names none takes."""

    classes: dict[str, float] = field(metadata={"description": "Each class's TTL in seconds."})
    default: str


@dataclass(frozen=True, slots=True, kw_only=True)
class InfoLimits:
    """The most a request may carry."""

    max_body_size: int = field(metadata={"description": "In bytes."})
    max_blocks_per_request: int
    max_tokens_per_request: int


@dataclass(frozen=True, slots=True, kw_only=True)
class InfoResponse:
    """What a worker must agree with to share this cache: hashing, block sizes, retention."""

    service: str
    version: str
    hashing: InfoHashing
    block_size: InfoBlockSizes
    retention: InfoRetention
    store: str = field(metadata={"description": "The store's backend: lmdb, memory or redis."})
    capacity_bytes: int | None
    limits: InfoLimits
    frame_media_type: str

    def block_size_for(self, model: str) -> int:
        """The tokens per block this service cuts `model`'s prompts into."""
        return self.block_size.models.get(model, self.block_size.default)


@dataclass(frozen=True, slots=True, kw_only=True)
class StatsDisk:
    """The room the store's file system has, measured now."""

    free_bytes: int
    file_bytes: int = field(metadata={"description": "What the store's data file takes."})
    limit_bytes: int = field(
        metadata={"description": "The most the store uses on this disk (it evicts within)."}
    )
    shortfall_bytes: int = field(
        metadata={"description": "How much of the capacity the disk cannot back."}
    )
    full: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class StatsTokens:
    """Prompt tokens looked up in one retention class, all worker processes."""

    hit_tokens: int
    miss_tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StatsTenant:
    """One tenant of the key file: its lookups, and the room its blocks take."""

    hit_tokens: int
    miss_tokens: int
    estimated_bytes: int
    capacity_bytes: int | None = field(metadata={"description": "Its quota; null if none."})


@dataclass(frozen=True, slots=True, kw_only=True)
class StatsResponse:
    """The store's size and room, and the hit and miss tokens by class and by tenant."""

    blocks: int
    payload_bytes: int
    used_bytes: int
    capacity_bytes: int | None
    disk: StatsDisk | None = field(metadata={"description": "Null for a store not on a disk."})
    pending_touches: int = field(
        metadata={"description": "Hits remembered, not yet written to the store."}
    )
    retention: dict[str, StatsTokens]
    tenants: dict[str, StatsTenant] = field(
        metadata={"description": "By tenant of the key file; empty without API keys."}
    )
    # Its shape is the KV-event hub's report (service/kv_events/hub.py, documented in the
    # engines guide), which follows the ingestion as it grows: an object per engine here.
    kv_events: dict[str, dict[str, Any]] | None = field(
        metadata={
            "description": "Per engine followed: where, how it hashes, and what its events "
            "brought (the answering worker's); null when KV-event ingestion is off."
        }
    )
