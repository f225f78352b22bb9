"""Whether an engine's BlockStored hashes are reproduced from its tokens, and if not, why.

A seed or scheme mismatch must never fail silently: routing on hashes we cannot reproduce
is a 0% hit rate that looks healthy. The subscriber checks stored events with
`verify_stored_event` and raises the alarm on mismatches; `diagnose_stored_event` (for
`cache-service doctor`) tries every registered scheme to name the likely cause.

An event's first block chains on its `parent_block_hash`. When that parent is a 64-bit
form (vLLM's default int hashes, SGLang's int64) its full chain state is known only if the
parent's own store event was verified before: callers keep the `states` a verification
returns, by normal form, and pass them back as `known_states`. Without them such an event
is "unverifiable", never a mismatch. Only an event that starts a prompt (no parent) shows a
wrong seed: later blocks chain on their parent whatever the root was.

An event's `extra_keys` are converted into the keys the engine hashed by the scheme's
`event_keys` (vLLM 0.32 publishes them untagged and hashes them tagged, with the LoRA
adapter's path, which the caller gives as `lora_path`: the engine's lora_modules). A LoRA
event whose adapter's path is not given is "unverifiable" (`lora_unknown`), never a
mismatch. When an event that shows extra keys is not reproduced with the scheme's
`extra_keys_form` but is with the other one, the configuration names the wrong release's
form: the event is "unverifiable" with `other_form` set, and no alarm about the seed.

An event without `extra_keys` (vLLM before they were published) does not show block 0's
cache_salt or multimodal keys. When its block 0 is not reproduced from the LoRA name alone
the event is "unverifiable" (`keys_unknown`), not a mismatch: a healthy engine serving salted
prompts must not raise the alarm. Its later blocks are still checked when block 0's
published hash is the full digest, so a wrong hash algorithm still shows.

vLLM's pickle schemes hash a block whose keys hold one string twice (a LoRA name equal to
the cache salt) differently when the caller passed one str object for both (an in-process
engine; see schemes/vllm.py). Such a block that is not reproduced is hashed again with the
equal strings as one object, and only a block that neither layout reproduces is a mismatch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from cache_service.core.engines.block_hashes import EngineBlockHash, normalize_block_hash
from cache_service.core.engines.schemes.registry import scheme_named
from cache_service.core.engines.schemes.scheme import (
    ChainState,
    EngineHashScheme,
    EventExtraKeys,
    ExtraKeys,
    LoraPathUnknown,
    PublishedHash,
)
from cache_service.core.engines.schemes.vllm import EXTRA_KEYS_FORMS, shared_strings_scheme

Outcome = Literal["reproduced", "mismatch", "unverifiable"]


@dataclass(frozen=True, slots=True)
class Verification:
    """One event's hashes against a scheme: how many leading blocks were reproduced."""

    outcome: Outcome
    blocks: int
    reproduced: int
    states: tuple[ChainState, ...]  # the reproduced blocks' chain states, for their children
    reason: str
    # Block 0 was not reproduced and the event does not show its extra keys: a cache_salt or
    # multimodal keys, or a wrong seed; this event cannot tell which.
    keys_unknown: bool = False
    # The LoRA adapter whose path the scheme hashes and the caller did not give.
    lora_unknown: str | None = None
    # The extra_keys_form that reproduces the event when the scheme's own does not.
    other_form: str | None = None

    @property
    def ok(self) -> bool:
        """Every block's hash was reproduced."""
        return self.outcome == "reproduced"


def _unverifiable(blocks: int, reason: str) -> Verification:
    return Verification("unverifiable", blocks, 0, (), reason)


def _parent_state(
    scheme: EngineHashScheme,
    parent: PublishedHash | None,
    known_states: Mapping[EngineBlockHash, ChainState] | None,
) -> tuple[bool, ChainState | None]:
    """(found, the parent's chain state); (True, None) for an event that starts a prompt."""
    if parent is None:
        return True, None
    state = scheme.recover(parent)
    if state is not None:
        return True, state
    if known_states is not None:
        state = known_states.get(normalize_block_hash(parent))
        if state is not None:
            return True, state
    return False, None


def verify_stored_event(
    scheme: EngineHashScheme,
    *,
    parent: PublishedHash | None,
    token_ids: Sequence[int],
    block_hashes: Sequence[PublishedHash],
    block_size: int,
    extra_keys: Sequence[EventExtraKeys] | None = None,
    lora_name: str | None = None,
    lora_path: str | None = None,
    known_states: Mapping[EngineBlockHash, ChainState] | None = None,
) -> Verification:
    """Whether a BlockStored's `block_hashes` are reproduced from its tokens by `scheme`.

    `extra_keys` is the event's per-block list (newer vLLM); without it a block's extra
    keys are the LoRA's alone, so an older event of a salted prompt cannot verify.
    `lora_path` is the path of the event's LoRA adapter, where the scheme hashes it."""
    event = _Event(parent, token_ids, block_hashes, block_size, extra_keys, lora_name, lora_path)
    result = _verify(scheme, event, known_states)
    if result.ok or not (lora_name is not None or any(extra_keys or ())):
        return result  # the forms differ only in extra keys: this event has none
    if result.outcome == "unverifiable" and not (result.keys_unknown or result.lora_unknown):
        return result
    other = _other_form(scheme)
    if other is None:
        return result
    retry = _verify(other, event, known_states)
    if retry.lora_unknown is not None and result.lora_unknown is None:
        # The other form hashes the LoRA's path, which is not given: this event cannot tell.
        why = f"{result.reason}; with extra_keys_form = {other.extra_keys_form!r}: {retry.reason}"
        return replace(retry, reason=why)
    if not retry.ok:
        return result
    reason = (
        f"{scheme.name} reproduces the event with extra_keys_form = "
        f"{other.extra_keys_form!r}, not the configured {scheme.extra_keys_form!r}: set the "
        "engine's extra_keys_form to its vLLM release's ('tagged' from vLLM 0.32, "
        "'untagged' before); the seed and hash algorithm are right"
    )
    return Verification(
        "unverifiable", result.blocks, 0, (), reason, other_form=other.extra_keys_form
    )


@dataclass(frozen=True, slots=True)
class _Event:
    """What of a stored event a verification reads."""

    parent: PublishedHash | None
    token_ids: Sequence[int]
    block_hashes: Sequence[PublishedHash]
    block_size: int
    extra_keys: Sequence[EventExtraKeys] | None
    lora_name: str | None
    lora_path: str | None


def _other_form(scheme: EngineHashScheme) -> EngineHashScheme | None:
    """The scheme with the other extra_keys_form, or None when it has no such choice."""
    if scheme.extra_keys_form is None:
        return None
    other = next(form for form in EXTRA_KEYS_FORMS if form != scheme.extra_keys_form)
    try:
        return scheme_named(scheme.name, seed=scheme.seed, extra_keys_form=other)
    except ValueError:  # a scheme not of the registry
        return None


def _verify(
    scheme: EngineHashScheme,
    event: _Event,
    known_states: Mapping[EngineBlockHash, ChainState] | None,
) -> Verification:
    """`verify_stored_event` with the scheme's own extra_keys_form only."""
    blocks = len(event.block_hashes)
    token_ids, block_size, extra_keys = event.token_ids, event.block_size, event.extra_keys
    if blocks == 0:
        return _unverifiable(0, "the event stores no blocks")
    if block_size <= 0 or len(token_ids) != blocks * block_size:
        return _unverifiable(
            blocks, f"{len(token_ids)} tokens are not {blocks} blocks of {block_size}"
        )
    if extra_keys is not None and len(extra_keys) != blocks:
        return _unverifiable(blocks, f"{len(extra_keys)} extra keys for {blocks} blocks")
    try:
        expected = [normalize_block_hash(value) for value in event.block_hashes]
        found, state = _parent_state(scheme, event.parent, known_states)
    except (TypeError, ValueError) as exc:
        return _unverifiable(blocks, f"a malformed block hash: {exc}")
    if not found:
        return _unverifiable(blocks, "the parent's chain state is unknown (not seen stored)")
    first_index = 0 if event.parent is None else 1  # only block 0 of a prompt takes the salt
    states: list[ChainState] = []
    for index in range(blocks):
        block = token_ids[index * block_size : (index + 1) * block_size]
        try:
            extra: ExtraKeys
            if extra_keys is not None:
                extra = scheme.event_keys(extra_keys[index], event.lora_name, event.lora_path)
            else:
                extra = scheme.extra_keys_rule(
                    first_index + index, event.lora_name, event.lora_path, None
                )
            state, got = _extend(scheme, state, block, extra, expected[index])
        except LoraPathUnknown as exc:
            return Verification("unverifiable", blocks, 0, (), str(exc), lora_unknown=exc.lora_name)
        except (TypeError, ValueError) as exc:
            return Verification("unverifiable", blocks, index, tuple(states), str(exc))
        if got != expected[index]:
            reason = (
                f"block {index}: {scheme.name} gives {got:016x}, "
                f"the event has {expected[index]:016x}"
            )
            if (
                index == 0
                and event.parent is None
                and extra_keys is None
                and scheme.covers_extra_keys
            ):
                return _unknown_block0_keys(scheme, event)
            return Verification("mismatch", blocks, index, tuple(states), reason)
        states.append(state)
    return Verification("reproduced", blocks, blocks, tuple(states), "")


def _extend(
    scheme: EngineHashScheme,
    parent: ChainState | None,
    block: Sequence[int],
    extra: ExtraKeys,
    want: EngineBlockHash,
) -> tuple[ChainState, EngineBlockHash]:
    """One block's chain state and normal form; when that is not `want`, the state of its
    equal strings hashed as one object if that is (`shared_strings_scheme`)."""
    state = scheme.extend(parent, block, extra)
    got = scheme.normal_form(state)
    shared = None if got == want else shared_strings_scheme(scheme, extra)
    if shared is not None:
        retry = shared.extend(parent, block, extra)
        if shared.normal_form(retry) == want:
            return retry, want
    return state, got


def _unknown_block0_keys(scheme: EngineHashScheme, event: _Event) -> Verification:
    """A start event whose block 0 did not reproduce and whose extra keys are not shown.

    The seed enters only through the root, that is block 0: blocks 1.. chain on block 0's
    digest whatever the seed was. So when block 0's published hash is that digest (vLLM
    with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) blocks 1.. still check the hash algorithm:
    a failure there is a mismatch. The int form keeps too little of the digest: block 0's
    salt or the seed stays unknown and nothing after it can be checked."""
    block_hashes, token_ids, block_size = event.block_hashes, event.token_ids, event.block_size
    blocks = len(block_hashes)
    why = (
        "block 0 was not reproduced and the event carries no extra_keys: its prompt may have "
        "a cache_salt or multimodal inputs (or the seed differs)"
    )
    first = block_hashes[0]
    state = scheme.recover(first)
    if state is None and isinstance(first, bytes | bytearray):
        reason = f"block 0: the event's digest is {len(first)} bytes, not {scheme.name}'s"
        return Verification("mismatch", blocks, 0, (), reason)
    if state is None or blocks == 1:
        return Verification("unverifiable", blocks, 0, (), why, keys_unknown=True)
    for index in range(1, blocks):
        block = token_ids[index * block_size : (index + 1) * block_size]
        try:
            # Blocks past 0 take the LoRA's keys only (the salt is block 0's).
            extra = scheme.extra_keys_rule(index, event.lora_name, event.lora_path, None)
            want = normalize_block_hash(block_hashes[index])
            state, got = _extend(scheme, state, block, extra, want)
        except (TypeError, ValueError) as exc:
            return Verification("unverifiable", blocks, 0, (), str(exc), keys_unknown=True)
        if got != want:
            reason = (
                f"block {index}: {scheme.name} gives {got:016x} from block 0's published "
                f"digest, the event has {want:016x}"
            )
            return Verification("mismatch", blocks, 0, (), reason)
    # Nothing is kept for children or the route memo: block 0's keys are still unknown.
    reason = f"{why}; blocks 1..{blocks - 1} were reproduced from block 0's published digest"
    return Verification("unverifiable", blocks, 0, (), reason, keys_unknown=True)
