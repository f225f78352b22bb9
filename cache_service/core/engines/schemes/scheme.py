"""One engine hash scheme: a root, a step that chains one full block onto its parent, and the
form the engine publishes a block's hash in.

Every engine we speak hashes a prompt the same way: full blocks only, block i hashed from its
parent's *chain state* (block i-1's, or the scheme's root for block 0), its tokens and, for
vLLM, its extra keys. What differs is the step, and that the hash an engine publishes in its
KV events is not always the state it chains on (SGLang publishes 8 of its 32 digest bytes,
vLLM by default 8 of its 32 or 16). So a scheme is data plus three functions, not a class
hierarchy; the families (vllm.py, sglang.py, xxh3_chain.py) build instances.

Two more functions say what a block's extra keys are: the rule that derives them for a text
prompt (block index, LoRA name and path, cache salt) and the conversion of the keys an
engine's events publish into the keys it hashed. vLLM 0.32 hashes tagged keys but publishes
them untagged, without the LoRA adapter's path, so the two differ by release.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cache_service.core.engines.block_hashes import EngineBlockHash, normalize_block_hash

ChainState = bytes | int  # what a block's child is hashed from: a full digest, or a u64
PublishedHash = bytes | int  # a block hash as the engine's KV events carry it
ExtraKeys = tuple[object, ...] | None  # vLLM's per-block extra keys; None when there are none
EventExtraKeys = Sequence[object] | None  # one block's extra keys as an event publishes them

Step = Callable[[ChainState | None, Sequence[int], ExtraKeys], ChainState]
Publish = Callable[[ChainState], PublishedHash]
Recover = Callable[[PublishedHash], ChainState | None]
# (block index, LoRA name, LoRA adapter path, cache salt) -> the block's extra keys
ExtraKeysRule = Callable[[int, str | None, str | None, str | None], ExtraKeys]
# (one block's published keys, the event's LoRA name, that adapter's path) -> keys as hashed
EventKeys = Callable[[EventExtraKeys, str | None, str | None], ExtraKeys]


class LoraPathUnknown(ValueError):
    """A scheme hashes a LoRA adapter's path, and the adapter's path was not given."""

    def __init__(self, lora_name: str) -> None:
        super().__init__(
            f"LoRA adapter {lora_name!r} is not in the engine's lora_modules: vLLM 0.32 "
            "hashes the adapter's path, which its KV events do not carry; add it there "
            "(name = path, as given to vLLM's --lora-modules)"
        )
        self.lora_name = lora_name


def no_extra_keys(
    block_index: int, lora_name: str | None, lora_path: str | None, cache_salt: str | None
) -> ExtraKeys:
    """The rule of a scheme whose hash covers tokens only (LoRA and salt are not hashed)."""
    return None


def keys_as_published(
    keys: EventExtraKeys, lora_name: str | None, lora_path: str | None
) -> ExtraKeys:
    """An event's keys hashed as they are published (a scheme's default conversion)."""
    return None if keys is None else tuple(keys)


@dataclass(frozen=True, slots=True)
class EngineHashScheme:
    """An engine's block hash: `extend` one block at a time, or hash a whole prompt."""

    name: str
    seed: str | None  # the root's seed (vLLM's PYTHONHASHSEED), None for seedless schemes
    root: ChainState | None  # the parent of block 0; None: block 0 is hashed without one
    step: Step
    publish: Publish  # chain state -> the hash the engine's events carry
    recover: Recover  # published hash -> chain state, None when the form drops bits
    extra_keys_rule: ExtraKeysRule = no_extra_keys  # a text prompt's keys of block i
    covers_extra_keys: bool = False  # whether LoRA / cache_salt change the hash at all
    event_keys: EventKeys = keys_as_published  # an event's published keys -> keys hashed
    extra_keys_form: str | None = None  # how a vLLM release hashes its keys; None: no keys

    def extend(
        self,
        parent: ChainState | None,
        block_tokens: Sequence[int],
        extra_keys: ExtraKeys = None,
    ) -> ChainState:
        """The chain state of one full block given its parent's (None: the first block)."""
        return self.step(self.root if parent is None else parent, block_tokens, extra_keys)

    def chain(
        self,
        tokens: Sequence[int],
        *,
        block_size: int,
        parent: ChainState | None = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
        cache_salt: str | None = None,
        extra_keys_by_block: Sequence[ExtraKeys] | None = None,
    ) -> list[ChainState]:
        """The chain states of every full block of `tokens` (a trailing partial block has
        none). Extra keys come from `extra_keys_by_block` when given (one per full block),
        else from the scheme's rule for `lora_name` (at `lora_path`) and `cache_salt`."""
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        full = len(tokens) // block_size
        if extra_keys_by_block is not None and len(extra_keys_by_block) < full:
            raise ValueError(f"{len(extra_keys_by_block)} extra keys for {full} full blocks")
        # Block indexes count from the prompt's start, so a chain resumed from a parent never
        # gets block 0's cache_salt again.
        first = 0 if parent is None else 1
        states: list[ChainState] = []
        state = parent
        for index in range(full):
            block = tokens[index * block_size : (index + 1) * block_size]
            if extra_keys_by_block is not None:
                extra = extra_keys_by_block[index]
            else:
                extra = self.extra_keys_rule(first + index, lora_name, lora_path, cache_salt)
            state = self.extend(state, block, extra)
            states.append(state)
        return states

    def block_hashes(
        self,
        tokens: Sequence[int],
        *,
        block_size: int,
        lora_name: str | None = None,
        lora_path: str | None = None,
        cache_salt: str | None = None,
        extra_keys_by_block: Sequence[ExtraKeys] | None = None,
    ) -> list[PublishedHash]:
        """The hashes the engine would publish for a prompt's full blocks, in its raw form."""
        states = self.chain(
            tokens,
            block_size=block_size,
            lora_name=lora_name,
            lora_path=lora_path,
            cache_salt=cache_salt,
            extra_keys_by_block=extra_keys_by_block,
        )
        return [self.publish(state) for state in states]

    def normalized(
        self,
        tokens: Sequence[int],
        *,
        block_size: int,
        lora_name: str | None = None,
        lora_path: str | None = None,
        cache_salt: str | None = None,
        extra_keys_by_block: Sequence[ExtraKeys] | None = None,
    ) -> list[EngineBlockHash]:
        """The prompt's block hashes in the 64-bit form the indexes keep."""
        return [
            normalize_block_hash(value)
            for value in self.block_hashes(
                tokens,
                block_size=block_size,
                lora_name=lora_name,
                lora_path=lora_path,
                cache_salt=cache_salt,
                extra_keys_by_block=extra_keys_by_block,
            )
        ]

    def normal_form(self, state: ChainState) -> EngineBlockHash:
        """A chain state's published hash in the 64-bit form."""
        return normalize_block_hash(self.publish(state))
