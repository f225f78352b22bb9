"""Engines' KV events, decoded from every msgpack encoding vLLM and SGLang have published.

One ZMQ message's payload is an event batch ``(ts, events, data_parallel_rank)``. Releases
have written it three ways (msgspec structs with ``tag=True``; ``array_like=True`` until
vLLM #42892 for the events, and for the batch until later still):

1. a positional batch of positional events: ``[ts, [["BlockStored", f1, f2, ...], ...]]``,
   ``[ts, events, rank]`` once a rank was added (vLLM's ``data_parallel_rank``, SGLang's
   ``attn_dp_rank``). An event is its tag then its fields in declaration order; msgspec
   writes every field of an array-like struct (``omit_defaults`` does not shorten arrays),
   so an older release only has fewer trailing fields;
2. a positional batch of tagged maps: ``[ts, [{"type": "BlockStored", "block_hashes": ...}]]``
   (vLLM after #42892, SGLang after #37482; omitted keys take their defaults);
3. a map batch of tagged maps: ``{"ts": ..., "events": [...], "data_parallel_rank": 0}``.

Positional fields, as releases appended them:

- ``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window.
  SGLang writes a metadata map (``{"cache_salt": ...}``) where vLLM has lora_name.
- ``BlockRemoved``: block_hashes, medium, group_idx.
- ``AllBlocksCleared``: nothing.

Unknown tags and unknown fields are ignored (counted), block hashes are folded into their
64-bit form, and anything else wrong raises `MalformedEvent` with a reason; an event that
is wrong inside a sound batch is skipped and its reason kept on the batch, so one bad event
never loses its neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack  # type: ignore[import-untyped]  # msgpack ships no stubs

from cache_service.core.engines.block_hashes import EngineBlockHash, normalize_block_hash

TAG_KEY = "type"
BLOCK_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
BLOCK_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
SGLANG_METADATA_POSITION = 7  # SGLang's BlockStoredMetadata map sits where vLLM has lora_name


class MalformedEvent(ValueError):
    """A payload that is not an event batch; `reason` says what was wrong."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks an engine stored (a chain: each block's parent is the one before it)."""

    block_hashes: tuple[EngineBlockHash, ...]
    parent_block_hash: EngineBlockHash | None = None
    token_ids: tuple[int, ...] | None = None
    block_size: int | None = None
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    cache_salt: str | None = None  # SGLang's metadata (or map field), not in vLLM's events
    bigram_tokens: bool = False  # SGLang under EAGLE sent (t_i, t_i+1) pairs; token_ids are t_i
    # The hashes as published (digest bytes or integers): a verifier chains on the parent's
    # full digest, which the 64-bit form has lost.
    raw_block_hashes: tuple[int | bytes, ...] = field(default=(), compare=False)
    raw_parent_block_hash: int | bytes | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks an engine evicted from one medium."""

    block_hashes: tuple[EngineBlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine emptied its prefix cache (reset_prefix_cache)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published batch; `unknown` counts events of tags we do not know, `malformed`
    holds the reason of each event skipped as malformed."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None
    unknown: int = 0
    malformed: tuple[str, ...] = ()


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one message's msgpack payload, in any released encoding."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise MalformedEvent(f"not msgpack: {type(exc).__name__}: {exc}") from exc
    return decode_batch_object(obj)


def decode_batch_object(obj: object) -> EventBatch:
    """Decode an already unpacked batch (a list or a map)."""
    if isinstance(obj, list):
        if len(obj) < 2:
            raise MalformedEvent(f"a positional batch has {len(obj)} fields, not >= 2")
        ts, raw_events = obj[0], obj[1]
        rank = obj[2] if len(obj) > 2 else None
    elif isinstance(obj, dict):
        if "ts" not in obj or "events" not in obj:
            raise MalformedEvent("a map batch without ts or events")
        ts, raw_events = obj["ts"], obj["events"]
        rank = obj.get("data_parallel_rank", obj.get("attn_dp_rank"))
    else:
        raise MalformedEvent(f"a batch is an array or a map, not {type(obj).__name__}")
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise MalformedEvent(f"ts is {type(ts).__name__}, not a number")
    if not isinstance(raw_events, list):
        raise MalformedEvent(f"events is {type(raw_events).__name__}, not an array")
    rank = _optional_int(rank, "data_parallel_rank")
    events: list[KVEvent] = []
    unknown = 0
    malformed: list[str] = []
    for raw in raw_events:
        try:
            event = decode_event(raw)
        except MalformedEvent as exc:
            malformed.append(exc.reason)
            continue
        if event is None:
            unknown += 1
        else:
            events.append(event)
    return EventBatch(float(ts), tuple(events), rank, unknown, tuple(malformed))


def decode_event(raw: object) -> KVEvent | None:
    """One event from its positional or tagged-map form; None for a tag we do not know."""
    if isinstance(raw, list):
        if not raw:
            raise MalformedEvent("an empty event array")
        tag, values = raw[0], raw[1:]
        if not isinstance(tag, str):
            raise MalformedEvent(f"an event's tag is {type(tag).__name__}, not a string")
        if tag == "BlockStored":
            fields = _positional_stored(values)
        elif tag == "BlockRemoved":
            fields = dict(zip(BLOCK_REMOVED_FIELDS, values, strict=False))
        else:
            fields = {}
    elif isinstance(raw, dict):
        tag = raw.get(TAG_KEY)
        if not isinstance(tag, str):
            raise MalformedEvent("an event map without a string 'type'")
        fields = raw
    else:
        raise MalformedEvent(f"an event is an array or a map, not {type(raw).__name__}")
    if tag == "BlockStored":
        return _block_stored(fields)
    if tag == "BlockRemoved":
        return BlockRemoved(
            block_hashes=_hashes(fields.get("block_hashes"), "block_hashes"),
            medium=_optional_str(fields.get("medium"), "medium"),
            group_idx=_optional_int(fields.get("group_idx"), "group_idx"),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _positional_stored(values: list[Any]) -> dict[str, Any]:
    fields = dict(zip(BLOCK_STORED_FIELDS, values, strict=False))
    if isinstance(fields.get("lora_name"), dict):
        # SGLang's BlockStoredWithMetadata: the 8th element is its metadata map.
        fields["metadata"] = fields.pop("lora_name")
    return fields


def _block_stored(fields: dict[str, Any]) -> BlockStored:
    metadata = fields.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise MalformedEvent(f"metadata is {type(metadata).__name__}, not a map")
    salt = fields.get("cache_salt")
    if salt is None and metadata is not None:
        salt = metadata.get("cache_salt")
    token_ids, bigram = _tokens(fields.get("token_ids"))
    parent = fields.get("parent_block_hash")
    raw_hashes = fields.get("block_hashes")
    return BlockStored(
        block_hashes=_hashes(raw_hashes, "block_hashes"),
        parent_block_hash=None if parent is None else _hash(parent, "parent_block_hash"),
        token_ids=token_ids,
        block_size=_optional_int(fields.get("block_size"), "block_size"),
        lora_id=_optional_int(fields.get("lora_id"), "lora_id"),
        medium=_optional_str(fields.get("medium"), "medium"),
        lora_name=_optional_str(fields.get("lora_name"), "lora_name"),
        extra_keys=_extra_keys(fields.get("extra_keys")),
        group_idx=_optional_int(fields.get("group_idx"), "group_idx"),
        kv_cache_spec_kind=_optional_str(fields.get("kv_cache_spec_kind"), "kv_cache_spec_kind"),
        kv_cache_spec_sliding_window=_optional_int(
            fields.get("kv_cache_spec_sliding_window"), "kv_cache_spec_sliding_window"
        ),
        cache_salt=_optional_str(salt, "cache_salt"),
        bigram_tokens=bigram,
        raw_block_hashes=tuple(raw_hashes) if isinstance(raw_hashes, list) else (),
        raw_parent_block_hash=parent,
    )


def _hash(value: object, field: str) -> EngineBlockHash:
    if isinstance(value, bool) or not isinstance(value, int | bytes):
        raise MalformedEvent(f"{field}: a hash is {type(value).__name__}, not int or bytes")
    if isinstance(value, int) and not -(1 << 63) <= value < (1 << 64):
        raise MalformedEvent(f"{field}: the integer hash {value} is wider than 64 bits")
    if isinstance(value, bytes) and not value:
        raise MalformedEvent(f"{field}: an empty hash")
    return normalize_block_hash(value)


def _hashes(value: object, field: str) -> tuple[EngineBlockHash, ...]:
    if not isinstance(value, list):
        raise MalformedEvent(f"{field} is {type(value).__name__}, not an array")
    return tuple(_hash(item, field) for item in value)


def _tokens(value: object) -> tuple[tuple[int, ...] | None, bool]:
    if value is None:
        return None, False
    if not isinstance(value, list):
        raise MalformedEvent(f"token_ids is {type(value).__name__}, not an array")
    if value and isinstance(value[0], list):
        # SGLang with EAGLE keys its radix tree by bigrams (t_i, t_i+1): keep each t_i.
        if not all(isinstance(pair, list) and len(pair) == 2 for pair in value):
            raise MalformedEvent("token_ids mixes tokens and pairs")
        return tuple(_token(pair[0]) for pair in value), True
    return tuple(_token(token) for token in value), False


def _token(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MalformedEvent(f"a token id is {value!r}, not a non-negative integer")
    return value


def _extra_keys(value: object) -> tuple[tuple[Any, ...] | None, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise MalformedEvent(f"extra_keys is {type(value).__name__}, not an array")
    keys: list[tuple[Any, ...] | None] = []
    for entry in value:
        if entry is not None and not isinstance(entry, list):
            raise MalformedEvent(f"an extra_keys entry is {type(entry).__name__}")
        keys.append(None if entry is None else _as_tuple(entry))
    return tuple(keys)


def _as_tuple(items: list[Any]) -> tuple[Any, ...]:
    # msgpack has no tuples; vLLM's extra keys are tuples, and hashing them back needs tuples.
    return tuple(_as_tuple(item) if isinstance(item, list) else item for item in items)


def _optional_int(value: object, field: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise MalformedEvent(f"{field} is {type(value).__name__}, not an integer")
    return value


def _optional_str(value: object, field: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise MalformedEvent(f"{field} is {type(value).__name__}, not a string")
