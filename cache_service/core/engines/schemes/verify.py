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

An event without `extra_keys` (vLLM before they were published) does not show block 0's
cache_salt or multimodal keys. When its block 0 is not reproduced from the LoRA name alone
the event is "unverifiable" (`keys_unknown`), not a mismatch: a healthy engine serving salted
prompts must not raise the alarm. Its later blocks are still checked when block 0's
published hash is the full digest, so a wrong hash algorithm still shows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from cache_service.core.engines.block_hashes import EngineBlockHash, normalize_block_hash
from cache_service.core.engines.schemes.registry import SCHEMES, scheme_named, scheme_names
from cache_service.core.engines.schemes.scheme import (
    ChainState,
    EngineHashScheme,
    ExtraKeys,
    PublishedHash,
)

Outcome = Literal["reproduced", "mismatch", "unverifiable"]
Cause = Literal["ok", "wrong-scheme", "wrong-seed", "unknown", "unverifiable"]

# Seeds operators commonly give PYTHONHASHSEED, tried when the configured one fails.
COMMON_SEEDS = ("0", "1", "42", "123", "1337", "12345", "random")


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
    extra_keys: Sequence[Sequence[object] | None] | None = None,
    lora_name: str | None = None,
    known_states: Mapping[EngineBlockHash, ChainState] | None = None,
) -> Verification:
    """Whether a BlockStored's `block_hashes` are reproduced from its tokens by `scheme`.

    `extra_keys` is the event's per-block list (newer vLLM); without it a block's extra
    keys are the LoRA name alone, so an older event of a salted prompt cannot verify."""
    blocks = len(block_hashes)
    if blocks == 0:
        return _unverifiable(0, "the event stores no blocks")
    if block_size <= 0 or len(token_ids) != blocks * block_size:
        return _unverifiable(
            blocks, f"{len(token_ids)} tokens are not {blocks} blocks of {block_size}"
        )
    if extra_keys is not None and len(extra_keys) != blocks:
        return _unverifiable(blocks, f"{len(extra_keys)} extra keys for {blocks} blocks")
    try:
        expected = [normalize_block_hash(value) for value in block_hashes]
        found, state = _parent_state(scheme, parent, known_states)
    except (TypeError, ValueError) as exc:
        return _unverifiable(blocks, f"a malformed block hash: {exc}")
    if not found:
        return _unverifiable(blocks, "the parent's chain state is unknown (not seen stored)")
    first_index = 0 if parent is None else 1  # only block 0 of a prompt takes the salt
    states: list[ChainState] = []
    for index in range(blocks):
        extra: ExtraKeys
        if extra_keys is not None:
            keys = extra_keys[index]
            extra = tuple(keys) if keys is not None else None
        else:
            extra = scheme.extra_keys_rule(first_index + index, lora_name, None)
        block = token_ids[index * block_size : (index + 1) * block_size]
        try:
            state = scheme.extend(state, block, extra)
        except (TypeError, ValueError) as exc:
            return Verification("unverifiable", blocks, index, tuple(states), str(exc))
        got = scheme.normal_form(state)
        if got != expected[index]:
            reason = (
                f"block {index}: {scheme.name} gives {got:016x}, "
                f"the event has {expected[index]:016x}"
            )
            if index == 0 and parent is None and extra_keys is None and scheme.covers_extra_keys:
                return _unknown_block0_keys(scheme, block_hashes, token_ids, block_size, lora_name)
            return Verification("mismatch", blocks, index, tuple(states), reason)
        states.append(state)
    return Verification("reproduced", blocks, blocks, tuple(states), "")


def _unknown_block0_keys(
    scheme: EngineHashScheme,
    block_hashes: Sequence[PublishedHash],
    token_ids: Sequence[int],
    block_size: int,
    lora_name: str | None,
) -> Verification:
    """A start event whose block 0 did not reproduce and whose extra keys are not shown.

    The seed enters only through the root, that is block 0: blocks 1.. chain on block 0's
    digest whatever the seed was. So when block 0's published hash is that digest (vLLM
    with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) blocks 1.. still check the hash algorithm:
    a failure there is a mismatch. The int form keeps too little of the digest: block 0's
    salt or the seed stays unknown and nothing after it can be checked."""
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
        # Blocks past 0 take the LoRA name only (the salt is block 0's).
        extra = scheme.extra_keys_rule(index, lora_name, None)
        try:
            state = scheme.extend(state, block, extra)
        except (TypeError, ValueError) as exc:
            return Verification("unverifiable", blocks, 0, (), str(exc), keys_unknown=True)
        got = scheme.normal_form(state)
        want = normalize_block_hash(block_hashes[index])
        if got != want:
            reason = (
                f"block {index}: {scheme.name} gives {got:016x} from block 0's published "
                f"digest, the event has {want:016x}"
            )
            return Verification("mismatch", blocks, 0, (), reason)
    # Nothing is kept for children or the route memo: block 0's keys are still unknown.
    reason = f"{why}; blocks 1..{blocks - 1} were reproduced from block 0's published digest"
    return Verification("unverifiable", blocks, 0, (), reason, keys_unknown=True)


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """Which schemes reproduce an event, and the likely cause when the configured one fails."""

    cause: Cause
    reproducing: tuple[str, ...]  # schemes reproducing it with the configured seed
    other_seeds: tuple[tuple[str, str], ...]  # (scheme, seed) reproducing it with another
    detail: str


def diagnose_stored_event(
    *,
    scheme_name: str,
    seed: str | int | None,
    parent: PublishedHash | None,
    token_ids: Sequence[int],
    block_hashes: Sequence[PublishedHash],
    block_size: int,
    extra_keys: Sequence[Sequence[object] | None] | None = None,
    lora_name: str | None = None,
    known_states: Mapping[EngineBlockHash, ChainState] | None = None,
    candidate_seeds: Sequence[str] = COMMON_SEEDS,
) -> Diagnosis:
    """Try every registered scheme on one stored event and name the likely cause."""

    keys_unknown: list[str] = []  # the reasons of schemes that could not see block 0's keys

    def outcome(name: str, try_seed: str | int | None) -> Outcome:
        result = verify_stored_event(
            scheme_named(name, seed=try_seed),
            parent=parent,
            token_ids=token_ids,
            block_hashes=block_hashes,
            block_size=block_size,
            extra_keys=extra_keys,
            lora_name=lora_name,
            known_states=known_states,
        )
        if result.keys_unknown:
            keys_unknown.append(result.reason)
        return result.outcome

    seeded = {name for name in scheme_names() if SCHEMES[name].uses_seed}
    outcomes = {
        name: outcome(name, seed)
        for name in scheme_names()
        if seed is not None or name not in seeded
    }
    reproducing = tuple(name for name, result in outcomes.items() if result == "reproduced")
    if scheme_name in reproducing:
        return Diagnosis("ok", reproducing, (), f"{scheme_name} reproduces the event")
    if reproducing:
        return Diagnosis(
            "wrong-scheme",
            reproducing,
            (),
            f"the engine hashes with {' or '.join(reproducing)}, not the configured "
            f"{scheme_name}: configure that scheme (or change the engine's)",
        )
    others = tuple(
        (name, candidate)
        for name in sorted(seeded)
        for candidate in candidate_seeds
        if candidate != (None if seed is None else str(seed))
        and outcome(name, candidate) == "reproduced"
    )
    if others:
        found = ", ".join(f"{name} with PYTHONHASHSEED={value}" for name, value in others)
        return Diagnosis(
            "wrong-seed",
            (),
            others,
            f"the engine's hashes match {found}, not {scheme_name} with seed {seed!r}: "
            "give the engine and the service the same seed",
        )
    configured = outcomes.get(scheme_name)  # None: a vLLM scheme without a seed
    if keys_unknown and configured != "mismatch":
        # A salted (or multimodal) prompt looks like a wrong seed here: say so, not "unknown".
        return Diagnosis(
            "unverifiable",
            (),
            (),
            f"{keys_unknown[0]}; send the engine an unsalted, text-only prompt of more than "
            "one block: if its event is not reproduced either, PYTHONHASHSEED differs",
        )
    # Without a seed, only an event that starts a prompt could show the configured scheme
    # wrong: a later one, that other schemes fail on, says nothing about it.
    if configured == "unverifiable" or (
        configured is None
        and (parent is not None or all(result == "unverifiable" for result in outcomes.values()))
    ):
        return Diagnosis(
            "unverifiable",
            (),
            (),
            "this event cannot tell (its parent's chain state is unknown or its shape is "
            "off); an event that starts a prompt can",
        )
    return Diagnosis(
        "unknown",
        (),
        (),
        f"no registered scheme reproduces the event with seed {seed!r} or a common one: "
        "for vLLM, PYTHONHASHSEED is most likely unset (a random root per process) or "
        "another value, or --prefix-caching-hash-algo differs; check the block size too",
    )
