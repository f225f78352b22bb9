"""Ingestion feeding the route memo: the segments an engine's verified stored events complete,
recorded in a `ChainMemo` exactly as `prompt_chain` would, so a prompt an engine already holds
is not hashed again on its first `/v1/route`.

A memo key is (scheme context, blocks from the prompt's start, XXH3-128 of the prompt's token
bytes up to there), at every `segment_blocks`-th block. An event knows only its own blocks'
tokens, so each ingested block is kept, by its 64-bit hash, as a link: its context, its index
in the prompt, its parent's hash and its tokens' bytes; a block closing a segment keeps the
XXH3 stream state there instead (a digest cannot be extended, a stream state can). A child
event walks back from its parent to the last segment boundary (at most `segment_blocks - 1`
links), resumes that stream over the links' bytes and its own, and records each segment it
completes with the segment's hashes and its last block's chain state.

Never a wrong entry: an event is fed only with the chain states the verifier reproduced; a
parent not seen (or no longer kept) ends the feed for that event; and under a scheme that
hashes extra keys every block's keys, as the engine hashed them (the scheme's `event_keys`
of the event's), must be what the scheme's rule gives for one (LoRA and its path, salt),
which then names the context (multimodal or prompt-embeds keys are never memoized). Links
are bounded per engine, least recently used dropped: about 275 bytes a block at 16 tokens
(a 64-byte bytes object, the link and its dict entry, a stream state per segment).
Single-threaded (the subscriber's); the memo it writes is locked.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from cache_service.core.engines.block_hashes import EngineBlockHash
from cache_service.core.engines.chain_memo import (
    ChainMemo,
    Segment,
    context_extras,
    scheme_context,
)
from cache_service.core.engines.schemes import (
    ChainState,
    EngineHashScheme,
    EventExtraKeys,
    ExtraKeys,
)
from cache_service.core.tokens import bytes_of_tokens, tokens_to_bytes

Context = tuple[object, ...]


@dataclass(slots=True)
class _Link:
    """One ingested block: where it sits in its prompt and what resumes the prefix digest."""

    context: Context
    index: int  # blocks before it in the prompt
    parent: EngineBlockHash | None
    data: bytes | None  # its tokens' bytes; None at a segment boundary (the stream has them)
    stream: Any  # xxhash.xxh3_128 after this block, at a segment boundary only


class MemoFeed:
    """Per engine, the links of ingested chains; feeds a ChainMemo the segments they close."""

    def __init__(self, memo: ChainMemo, *, max_blocks_per_engine: int) -> None:
        if max_blocks_per_engine < 1:
            raise ValueError("max_blocks_per_engine must be at least 1")
        self.memo = memo
        self.max_blocks = max_blocks_per_engine
        self._recorded: dict[str, int] = {}  # segments recorded into the memo, per engine
        self.skipped = 0  # events not fed: unknown parent, foreign extra keys, odd tokens
        self._links: dict[str, OrderedDict[EngineBlockHash, _Link]] = {}

    def segments_recorded(self, engine: str) -> int:
        """How many segments an engine's events have recorded into the memo (ever)."""
        return self._recorded.get(engine, 0)

    def blocks(self, engine: str) -> int:
        """How many blocks' links are kept for an engine."""
        return len(self._links.get(engine, ()))

    def feed(
        self,
        engine: str,
        scheme: EngineHashScheme,
        *,
        block_size: int,
        parent: EngineBlockHash | None,
        hashes: Sequence[EngineBlockHash],
        states: Sequence[ChainState],
        token_ids: Sequence[int],
        extra_keys: Sequence[EventExtraKeys] | None = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
    ) -> int:
        """Record the segments a stored event completes (its blocks' 64-bit `hashes` and the
        verified chain `states` of its leading blocks); how many were recorded. `lora_path`
        is the event's LoRA adapter's path, for a scheme that hashes it."""
        blocks = min(len(hashes), len(states))
        if blocks == 0 or block_size <= 0 or len(token_ids) < blocks * block_size:
            return 0
        links = self._links.setdefault(engine, OrderedDict())
        try:
            hashed = _hashed_keys(scheme, extra_keys, lora_name, lora_path)
        except ValueError:  # a LoRA path not given, a key of no known kind
            self.skipped += 1
            return 0
        start = self._resume(
            links,
            scheme,
            block_size=block_size,
            parent=parent,
            lora_name=lora_name,
            lora_path=lora_path,
            extra_keys=hashed,
        )
        if start is None:
            self.skipped += 1
            return 0
        context, first_index, stream, pending = start
        try:
            data = tokens_to_bytes(token_ids[: blocks * block_size])
        except ValueError:  # an id outside u32 has no byte form (nor a route memo key)
            self.skipped += 1
            return 0
        if not _extras_fit(
            scheme,
            context,
            first_index=first_index,
            blocks=blocks,
            extra_keys=hashed,
            lora_name=lora_name,
            lora_path=lora_path,
        ):
            self.skipped += 1
            return 0
        per_segment = self.memo.segment_blocks
        width = bytes_of_tokens(block_size)
        recorded = 0
        for offset in range(blocks):
            index = first_index + offset
            chunk = data[offset * width : (offset + 1) * width]
            stream.update(chunk)
            pending.append(hashes[offset])
            boundary = (index + 1) % per_segment == 0
            if boundary:
                key = (context, index + 1, stream.intdigest())
                self.memo.put(key, Segment(array("Q", pending), states[offset]))
                pending = []
                recorded += 1
            links[hashes[offset]] = _Link(
                context,
                index,
                parent if offset == 0 else hashes[offset - 1],
                None if boundary else chunk,
                stream.copy() if boundary else None,
            )
            links.move_to_end(hashes[offset])
        while len(links) > self.max_blocks:
            links.popitem(last=False)
        self._recorded[engine] = self._recorded.get(engine, 0) + recorded
        return recorded

    def _resume(
        self,
        links: OrderedDict[EngineBlockHash, _Link],
        scheme: EngineHashScheme,
        *,
        block_size: int,
        parent: EngineBlockHash | None,
        lora_name: str | None,
        lora_path: str | None,
        extra_keys: Sequence[ExtraKeys] | None,
    ) -> tuple[Context, int, Any, list[EngineBlockHash]] | None:
        """(context, index of the event's first block, the stream resumed just before it,
        the hashes of its segment's blocks before it), or None if it cannot be resumed."""
        if parent is None:
            fits, salt = _salt_of(scheme, lora_name, lora_path, extra_keys)
            if not fits:
                return None
            context = scheme_context(scheme, block_size, lora_name, lora_path, salt)
            return context, 0, xxhash.xxh3_128(), []
        link = links.get(parent)
        if link is None:
            return None
        walked: list[tuple[EngineBlockHash, _Link]] = []
        key, current = parent, link
        while current.stream is None:
            walked.append((key, current))
            if current.index == 0:
                stream = xxhash.xxh3_128()
                break
            if current.parent is None or (earlier := links.get(current.parent)) is None:
                return None
            key, current = current.parent, earlier
        else:
            stream = current.stream.copy()
        walked.reverse()
        for walked_key, step in walked:
            assert step.data is not None
            stream.update(step.data)
            links.move_to_end(walked_key)
        return link.context, link.index + 1, stream, [walked_key for walked_key, _ in walked]


def _hashed_keys(
    scheme: EngineHashScheme,
    extra_keys: Sequence[EventExtraKeys] | None,
    lora_name: str | None,
    lora_path: str | None,
) -> list[ExtraKeys] | None:
    """The event's per-block keys as the engine hashed them (None when it shows none);
    ValueError when they cannot be had."""
    if extra_keys is None or not scheme.covers_extra_keys:
        return None
    return [scheme.event_keys(keys, lora_name, lora_path) for keys in extra_keys]


def _salt_of(
    scheme: EngineHashScheme,
    lora_name: str | None,
    lora_path: str | None,
    extra_keys: Sequence[ExtraKeys] | None,
) -> tuple[bool, str | None]:
    """(whether the prompt's first block's hashed keys are the rule's for some cache salt,
    that salt or None)."""
    if not scheme.covers_extra_keys or not extra_keys:
        return True, None
    first = extra_keys[0]
    try:
        if first == scheme.extra_keys_rule(0, lora_name, lora_path, None):
            return True, None
        # The salt is the last key: bare (untagged) or ("cache_salt", salt) (tagged).
        last = first[-1] if first else None
        salt = last[-1] if isinstance(last, tuple) and len(last) == 2 else last
        if isinstance(salt, str) and salt:
            return first == scheme.extra_keys_rule(0, lora_name, lora_path, salt), salt
    except ValueError:  # the rule needs a LoRA path that is not given
        pass
    return False, None


def _extras_fit(
    scheme: EngineHashScheme,
    context: Context,
    *,
    first_index: int,
    blocks: int,
    extra_keys: Sequence[ExtraKeys] | None,
    lora_name: str | None,
    lora_path: str | None,
) -> bool:
    """Whether every block was hashed with the extra keys `prompt_chain` gives the context."""
    if not scheme.covers_extra_keys:
        return True
    context_lora, context_path, context_salt = context_extras(context)
    if extra_keys is None:
        # Verified with the rule for the event's LoRA and no salt: the context's only if
        # the LoRA is the same and the prompt has no salt.
        return (lora_name, lora_path) == (context_lora, context_path) and context_salt is None
    if len(extra_keys) < blocks:
        return False
    try:
        return all(
            extra_keys[offset]
            == scheme.extra_keys_rule(
                first_index + offset, context_lora, context_path, context_salt
            )
            for offset in range(blocks)
        )
    except ValueError:  # the rule needs a LoRA path that is not given
        return False
