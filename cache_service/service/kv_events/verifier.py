"""The subscriber's verify hook: does an engine's configured scheme and seed reproduce the
block hashes of its BlockStored events from their tokens?

A mismatch is how a wrong `PYTHONHASHSEED`, hash algorithm or block size shows: routing on
hashes we cannot reproduce is a silent 0% hit rate. Only an event that starts a prompt (no
parent) or whose parent's chain state we know can be checked, since vLLM's default int
hashes and SGLang's int64 keep 64 bits of the digest a child is hashed from. So the chain
states of every verified block are kept, by their 64-bit form, in a bounded map per engine:
a later event of the same prompt then chains on its verified parent.

Answers as the subscriber expects: True (reproduced), False (a mismatch: counted and
alarmed), None (cannot tell: no scheme, bigram tokens, an unknown parent, an odd shape, a
LoRA adapter missing from the engine's lora_modules). An event the configured scheme and
seed reproduce only with the other vLLM release's extra-keys form is no mismatch either (the
seed is right): it is counted, and logged once per engine naming `extra_keys_form`, since
the engine's salted and LoRA prompts score nothing until the configuration says the form.
It runs in the subscriber's thread only; `last_mismatch` is read from any thread (a dict
read of an immutable string). Given the route's `ChainMemo`, it also records there the
segments of the prompts whose blocks it reproduced (memo_feed.py): the memo is locked.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable

from cache_service.core.engines.block_hashes import EngineBlockHash, normalize_block_hash
from cache_service.core.engines.chain_memo import ChainMemo
from cache_service.core.engines.decoding import BlockStored
from cache_service.core.engines.memo_feed import MemoFeed
from cache_service.core.engines.schemes import (
    ChainState,
    EngineHashScheme,
    PublishedHash,
    scheme_named,
    verify_stored_event,
)
from cache_service.service.kv_events.config import EngineConfig

log = logging.getLogger("cache_service.kv_events")

# Chain states kept per engine: a 32-byte digest and its key take about 150 bytes, so the
# default costs some 10 MB per engine at most. A prompt whose parent fell out is only
# unverifiable, never a mismatch.
DEFAULT_KNOWN_STATES = 65_536
# Prompts an engine may start, none of them verifiable for keys its events do not show (an
# older vLLM: no extra_keys), before the service says it cannot check the engine at all: a
# wrong seed would look exactly like that, so it must not stay silent.
UNVERIFIABLE_STARTS_WARNING = 16


class SchemeVerifier:
    """Verifies stored events with each engine's configured scheme and seed."""

    def __init__(
        self,
        engines: Iterable[EngineConfig],
        *,
        max_known_states_per_engine: int = DEFAULT_KNOWN_STATES,
        chain_memo: ChainMemo | None = None,
    ) -> None:
        if max_known_states_per_engine < 1:
            raise ValueError("max_known_states_per_engine must be at least 1")
        self.max_known_states = max_known_states_per_engine
        self._schemes: dict[str, EngineHashScheme | None] = {}
        for engine in engines:
            self._schemes[engine.name] = _scheme_of(engine)
        self._known: dict[str, OrderedDict[EngineBlockHash, ChainState]] = {}
        self._last_mismatch: dict[str, str] = {}
        # Per engine: starts verified, and starts that could not be for unknown keys.
        self._verified_starts: dict[str, int] = {}
        self._unknown_key_starts: dict[str, int] = {}
        # Per engine: events reproduced only with the other extra_keys_form, and why.
        self._wrong_form: dict[str, int] = {}
        self._last_wrong_form: dict[str, str] = {}
        self._unknown_loras: dict[str, set[str]] = {}  # adapters not in lora_modules, warned
        # Verified prompts' segments go to the route memo, so a prompt an engine stored is
        # not hashed on its first /v1/route (links bounded like the chain states).
        self.memo_feed = (
            None
            if chain_memo is None
            else MemoFeed(chain_memo, max_blocks_per_engine=max_known_states_per_engine)
        )

    def last_mismatch(self, engine: str) -> str | None:
        """Why the engine's latest mismatching event did not verify; None if none did."""
        return self._last_mismatch.get(engine)

    def memo_segments(self, engine: str) -> int:
        """How many route-memo segments the engine's stored events have recorded (ever)."""
        return 0 if self.memo_feed is None else self.memo_feed.segments_recorded(engine)

    def wrong_form_events(self, engine: str) -> int:
        """Events the engine's scheme and seed reproduce only with the other extra_keys_form."""
        return self._wrong_form.get(engine, 0)

    def last_wrong_form(self, engine: str) -> str | None:
        """Why the engine's latest such event says its extra_keys_form is wrong; None if none."""
        return self._last_wrong_form.get(engine)

    def known_states(self, engine: str) -> int:
        """How many verified chain states are kept for an engine."""
        return len(self._known.get(engine, ()))

    def __call__(self, engine: EngineConfig, event: BlockStored) -> bool | None:
        """True if the engine's scheme reproduces the event's hashes, False if it does not,
        None if this event cannot tell."""
        if engine.name not in self._schemes:  # an engine added after start-up
            self._schemes[engine.name] = _scheme_of(engine)
        scheme = self._schemes[engine.name]
        if scheme is None or event.bigram_tokens or not event.token_ids:
            return None
        if event.block_size is not None and event.block_size != engine.block_size:
            # Prompts are hashed in blocks of the configured size: nothing would line up.
            return self._mismatch(
                engine,
                f"the engine stores blocks of {event.block_size} tokens, the configuration "
                f"says {engine.block_size} (block_size)",
            )
        hashes = _published_hashes(event)
        parent = (
            event.raw_parent_block_hash
            if event.raw_parent_block_hash is not None
            else event.parent_block_hash
        )
        known = self._known.setdefault(engine.name, OrderedDict())
        result = verify_stored_event(
            scheme,
            parent=parent,
            token_ids=event.token_ids,
            block_hashes=hashes,
            block_size=engine.block_size,
            extra_keys=event.extra_keys,
            lora_name=event.lora_name,
            lora_path=engine.lora_path(event.lora_name),
            known_states=known,
        )
        if result.other_form is not None:
            self._note_wrong_form(engine, result.reason)
        elif result.lora_unknown is not None:
            self._note_unknown_lora(engine, result.lora_unknown, result.reason)
        self._remember(known, hashes, result.states)
        if self.memo_feed is not None and result.states:
            self._feed_memo(
                engine, scheme, event, parent=parent, hashes=hashes, states=result.states
            )
        if parent is None:
            self._count_start(engine, result.outcome, keys_unknown=result.keys_unknown)
        if result.outcome == "reproduced":
            return True
        if result.outcome == "mismatch":
            if parent is None:
                reason = (
                    f"an event that starts a prompt: {result.reason}; the engine's hash "
                    "algorithm or PYTHONHASHSEED differs from the configuration (run "
                    "`cache-service doctor`)"
                )
            else:
                reason = (
                    f"a chained event: {result.reason}; the engine's hash algorithm or "
                    "extra keys (LoRA, cache salt) differ"
                )
            return self._mismatch(engine, reason)
        return None

    def _count_start(self, engine: EngineConfig, outcome: str, *, keys_unknown: bool) -> None:
        """Warn once when an engine's prompts start, again and again, where nothing can be
        verified: its seed may be wrong, and no mismatch would ever say so."""
        name = engine.name
        if outcome == "reproduced":
            self._verified_starts[name] = self._verified_starts.get(name, 0) + 1
            return
        if not keys_unknown:
            return
        count = self._unknown_key_starts.get(name, 0) + 1
        self._unknown_key_starts[name] = count
        if count == UNVERIFIABLE_STARTS_WARNING and not self._verified_starts.get(name):
            log.warning(
                "engine %s: the first blocks of %d prompts could not be verified: its events "
                "do not carry extra_keys (an older vLLM), and without them block 0 does not "
                "reproduce with %s and the configured seed. Either every prompt is salted "
                "(cache_salt) or multimodal, or PYTHONHASHSEED or the hash algorithm differ: "
                "run `cache-service doctor` while the engine serves an unsalted text prompt",
                name,
                count,
                engine.hash_scheme,
            )

    def _note_wrong_form(self, engine: EngineConfig, reason: str) -> None:
        count = self._wrong_form.get(engine.name, 0) + 1
        self._wrong_form[engine.name] = count
        self._last_wrong_form[engine.name] = reason
        if count == 1:  # the form is configured once per engine: once is enough to say so
            log.warning(
                "engine %s: a stored event is reproduced only with the other extra-keys form "
                "(its salted and LoRA prompts score no cached blocks until extra_keys_form "
                "is set): %s",
                engine.name,
                reason,
            )

    def _note_unknown_lora(self, engine: EngineConfig, lora_name: str, reason: str) -> None:
        warned = self._unknown_loras.setdefault(engine.name, set())
        if lora_name not in warned:
            warned.add(lora_name)
            log.warning("engine %s: a LoRA event cannot be verified: %s", engine.name, reason)

    def unverifiable_starts(self, engine: str) -> int:
        """Prompts the engine started whose first block could not be verified (keys unknown)."""
        return self._unknown_key_starts.get(engine, 0)

    def _remember(
        self,
        known: OrderedDict[EngineBlockHash, ChainState],
        hashes: tuple[PublishedHash, ...],
        states: tuple[ChainState, ...],
    ) -> None:
        for published, state in zip(hashes, states, strict=False):
            key = normalize_block_hash(published)
            known[key] = state
            known.move_to_end(key)
        while len(known) > self.max_known_states:
            known.popitem(last=False)

    def _feed_memo(
        self,
        engine: EngineConfig,
        scheme: EngineHashScheme,
        event: BlockStored,
        *,
        parent: PublishedHash | None,
        hashes: tuple[PublishedHash, ...],
        states: tuple[ChainState, ...],
    ) -> None:
        assert self.memo_feed is not None and event.token_ids is not None
        try:  # reproduced hashes and their parent were normalised by the check already
            normal = [normalize_block_hash(value) for value in hashes[: len(states)]]
            parent_normal = None if parent is None else normalize_block_hash(parent)
        except (TypeError, ValueError):
            return
        self.memo_feed.feed(
            engine.name,
            scheme,
            block_size=engine.block_size,
            parent=parent_normal,
            hashes=normal,
            states=states,
            token_ids=event.token_ids,
            extra_keys=event.extra_keys,
            lora_name=event.lora_name,
            lora_path=engine.lora_path(event.lora_name),
        )

    def _mismatch(self, engine: EngineConfig, reason: str) -> bool:
        if engine.name not in self._last_mismatch:
            # The subscriber raises the alarm after a few; the first one's cause is logged
            # here, since a count alone does not say what to fix.
            log.warning(
                "engine %s: a stored event's block hashes were not reproduced: %s",
                engine.name,
                reason,
            )
        self._last_mismatch[engine.name] = reason
        return False


def _scheme_of(engine: EngineConfig) -> EngineHashScheme | None:
    if engine.hash_scheme is None:
        return None
    try:
        return scheme_named(
            engine.hash_scheme, seed=engine.seed, extra_keys_form=engine.extra_keys_form
        )
    except ValueError:  # the settings refuse these; an engine built elsewhere is not verified
        log.warning("engine %s: its hash scheme cannot be used; not verifying", engine.name)
        return None


def _published_hashes(event: BlockStored) -> tuple[PublishedHash, ...]:
    """The hashes as the engine published them (the 64-bit forms for an event built by hand)."""
    if len(event.raw_block_hashes) == len(event.block_hashes):
        return event.raw_block_hashes
    return tuple(event.block_hashes)
