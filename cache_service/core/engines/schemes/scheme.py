"""One engine hash scheme: a root, a step that chains one full block onto its parent, and the
form the engine publishes a block's hash in.

Every engine we speak hashes a prompt the same way: full blocks only, block i hashed from its
parent's *chain state* (block i-1's, or the scheme's root for block 0), its tokens and, for
vLLM, its extra keys. What differs is the step, and that the hash an engine publishes in its
KV events is not always the state it chains on (SGLang publishes 8 of its 32 digest bytes,
vLLM by default 8 of its 32 or 16). So a scheme is data plus three functions, not a class
hierarchy; the families (vllm.py, sglang.py, xxh3_chain.py) build instances.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cache_service.core.engines.block_hashes import EngineBlockHash, normalize_block_hash

ChainState = bytes | int  # what a block's child is hashed from: a full digest, or a u64
PublishedHash = bytes | int  # a block hash as the engine's KV events carry it
ExtraKeys = tuple[object, ...] | None  # vLLM's per-block extra keys; None when there are none

Step = Callable[[ChainState | None, Sequence[int], ExtraKeys], ChainState]
Publish = Callable[[ChainState], PublishedHash]
Recover = Callable[[PublishedHash], ChainState | None]
ExtraKeysRule = Callable[[int, str | None, str | None], ExtraKeys]


def no_extra_keys(block_index: int, lora_name: str | None, cache_salt: str | None) -> ExtraKeys:
    """The rule of a scheme whose hash covers tokens only (LoRA and salt are not hashed)."""
    return None


@dataclass(frozen=True, slots=True)
class EngineHashScheme:
    """An engine's block hash: `extend` one block at a time, or hash a whole prompt."""

    name: str
    seed: str | None  # the root's seed (vLLM's PYTHONHASHSEED), None for seedless schemes
    root: ChainState | None  # the parent of block 0; None: block 0 is hashed without one
    step: Step
    publish: Publish  # chain state -> the hash the engine's events carry
    recover: Recover  # published hash -> chain state, None when the form drops bits
    extra_keys_rule: ExtraKeysRule = no_extra_keys  # (block index, lora, salt) -> extra keys
    covers_extra_keys: bool = False  # whether LoRA / cache_salt change the hash at all

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
        cache_salt: str | None = None,
        extra_keys_by_block: Sequence[ExtraKeys] | None = None,
    ) -> list[ChainState]:
        """The chain states of every full block of `tokens` (a trailing partial block has
        none). Extra keys come from `extra_keys_by_block` when given (one per full block),
        else from the scheme's rule for `lora_name` and `cache_salt`."""
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
                extra = self.extra_keys_rule(first + index, lora_name, cache_salt)
            state = self.extend(state, block, extra)
            states.append(state)
        return states

    def block_hashes(
        self,
        tokens: Sequence[int],
        *,
        block_size: int,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        extra_keys_by_block: Sequence[ExtraKeys] | None = None,
    ) -> list[PublishedHash]:
        """The hashes the engine would publish for a prompt's full blocks, in its raw form."""
        states = self.chain(
            tokens,
            block_size=block_size,
            lora_name=lora_name,
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
                cache_salt=cache_salt,
                extra_keys_by_block=extra_keys_by_block,
            )
        ]

    def normal_form(self, state: ChainState) -> EngineBlockHash:
        """A chain state's published hash in the 64-bit form."""
        return normalize_block_hash(self.publish(state))
