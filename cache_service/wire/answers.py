"""The service's JSON answers: lookup, store, a fetch's frame header, a routing question, and
where a client on the service's host reads payloads itself.

Each is a frozen dataclass whose fields are the JSON object's, in the order the service
writes them (orjson writes a dataclass's fields in order, so the bytes on the wire follow this
file). The service's OpenAPI document is generated from these classes (pydantic reads a
stdlib dataclass: its docstring is the schema's description, and a field's `metadata` its
keywords), so a class's name is its schema's name. The client's answers are these classes
(Match adds the payloads), so their positional order is the client's API as well.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Self

STORE_MEDIUM = "store"  # the medium of the payload store's row in a route answer


@dataclass(frozen=True, slots=True)
class Usage:
    """Per-request token accounting, as OpenAI-style APIs report prompt caching."""

    prompt_cache_hit_tokens: int
    prompt_cache_miss_tokens: int


# Keyword-only: the client's Match adds its payloads, and its fields were once in another
# order, so a positional call from before fails at once instead of swapping two counts.
@dataclass(frozen=True, slots=True, kw_only=True)
class LookupResponse:
    """The longest cached prefix; with fetch, the header of a frame body."""

    model: str
    block_size: int  # 0 in a client's fail-open miss when the caller did not name one
    prompt_tokens: int
    matched_blocks: int
    cached_tokens: int
    keys: list[str]  # 32 lowercase hex characters each
    retention: str  # "" in a client's fail-open miss when the caller did not name one
    usage: Usage

    @classmethod
    def miss(cls, *, model: str, prompt_tokens: int, block_size: int, retention: str) -> Self:
        """The empty answer: no block of the prompt is cached."""
        return cls(
            model=model,
            block_size=block_size,
            prompt_tokens=prompt_tokens,
            matched_blocks=0,
            cached_tokens=0,
            keys=[],
            retention=retention,
            usage=Usage(prompt_cache_hit_tokens=0, prompt_cache_miss_tokens=prompt_tokens),
        )


@dataclass(frozen=True, slots=True)
class StoreResponse:
    """What a store request did."""

    model: str
    block_size: int  # 0 in a client's fail-open miss when the caller did not name one
    start_block: int
    requested_blocks: int
    stored_blocks: int = field(metadata={"description": "Blocks newly stored (and still held)."})
    refreshed_blocks: int = field(
        metadata={"description": "Blocks already stored; refreshed, kept as first written."}
    )
    conflicts: int = field(
        metadata={"description": "Refreshed blocks whose bytes differed from the stored ones."}
    )
    truncated_blocks: int = field(
        metadata={"description": "Blocks not stored: the request exceeds the cache."}
    )
    collisions: int = field(
        metadata={"description": "Blocks refused: another block holds their key."}
    )
    keys: list[str] = field(metadata={"description": "Keys of the blocks sent, in order."})

    @classmethod
    def miss(cls, *, model: str, block_size: int, start_block: int, requested_blocks: int) -> Self:
        """The empty answer: none of the blocks sent was stored."""
        return cls(
            model=model,
            block_size=block_size,
            start_block=start_block,
            requested_blocks=requested_blocks,
            stored_blocks=0,
            refreshed_blocks=0,
            conflicts=0,
            truncated_blocks=0,
            collisions=0,
            keys=[],
        )

    @property
    def identical_blocks(self) -> int:
        """Blocks already stored with the very bytes sent."""
        return self.refreshed_blocks - self.conflicts

    @property
    def as_sent(self) -> bool:
        """Whether the cache now holds every block sent, each with the bytes sent."""
        held = self.stored_blocks + self.refreshed_blocks
        return held == self.requested_blocks and not self.conflicts


@dataclass(frozen=True, slots=True)
class FetchHeader:
    """The header of a fetch answer; one frame per requested key (absent = gone)."""

    model: str
    requested: int
    found: int


@dataclass(frozen=True, slots=True)
class RouteInstance:
    """One instance's hold on the prompt in one medium (or, as `best`, the store's)."""

    # The service always sends `live`; its default is for answers of services that came
    # before liveness. This keeps such a field required in the published (serialization)
    # schema, which then states the default too.
    __pydantic_config__: ClassVar[dict[str, bool]] = {
        "json_schema_serialization_defaults_required": True
    }

    instance: str | None = field(
        metadata={"description": "The engine; null for the payload store."}
    )
    medium: str = field(
        metadata={"description": "GPU, CPU or DISK; `store` for the payload store."}
    )
    matched_blocks: int
    cached_tokens: int = field(metadata={"description": "matched_blocks x block_size."})
    tokens_to_prefill: int = field(metadata={"description": "prompt_tokens - cached_tokens."})
    block_size: int
    data_parallel_rank: int | None = field(
        metadata={"description": "The rank holding them; null if none."}
    )
    stale: bool = field(metadata={"description": "The engine lost events: its view may be wrong."})
    live: bool = field(
        default=True,
        metadata={
            "description": "False when the engine's publisher went away (disconnected, or "
            "silent past the timeout): ranked after live engines, never best, and left out of "
            "answers once down past the grace (then listed in unscored)."
        },
    )


@dataclass(frozen=True, slots=True)
class RouteStore:
    """The payload store as an instance of its own: any worker can load these blocks."""

    matched_blocks: int
    cached_tokens: int
    tokens_to_prefill: int
    block_size: int


@dataclass(frozen=True, slots=True)
class RouteUnscored:
    """An engine whose blocks cannot be matched to a prompt, and why."""

    instance: str
    reason: str


@dataclass(frozen=True, slots=True)
class RouteResponse:
    """Per instance and medium, best first; the payload store; the best of all."""

    model: str
    prompt_tokens: int
    instances: list[RouteInstance]
    store: RouteStore
    best: RouteInstance | None = field(
        metadata={
            "description": "The row holding the most tokens, an instance before the store on "
            "a tie, a sound instance before a stale one (whatever their tokens; a stale one only "
            "when no sound instance holds a block); null when nothing holds a single block of "
            "the prompt."
        }
    )
    unscored: list[RouteUnscored]


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalReadsResponse:
    """What a client on the service's own host needs to read payloads straight from the
    store's LMDB files, verified as the service verifies them (answered only with
    --local-reads)."""

    path: str = field(metadata={"description": "The LMDB folder, as the service opened it."})
    store_id: str = field(
        metadata={"description": "The store's own random id, made with it: files at the path "
                  "holding another id are another store's."}
    )  # fmt: skip
    boot_id: str = field(
        metadata={"description": "The kernel's boot id: a client whose own differs is on "
                  "another host (or a restarted one) and must not use the path."}
    )  # fmt: skip
    seed: str = field(metadata={"description": "The hash seed the store's keys are made with."})
    tenant: str = field(metadata={"description": "The caller's tenant, as its key names it."})
    retention: dict[str, float] = field(
        metadata={"description": "Each class's TTL in seconds: a block is judged alive as the "
                  "service judges it."}
    )  # fmt: skip
    slack_seconds: float
    default_block_size: int
    block_sizes: dict[str, int] = field(
        metadata={"description": "Models whose block size is not the default."}
    )
