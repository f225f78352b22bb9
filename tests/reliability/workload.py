"""Deterministic prompts whose payloads derive from their tokens, and a verifier of answers.

Block i of a prompt carries `payload_of(model, tokens of blocks 0..i, i)`: a function of what
the block's key stands for, so every byte the service returns can be checked on its own,
without remembering what was sent, and two prompts sharing a prefix send identical bytes for
it (never a conflict). Prompts of one family share their first blocks, so stores overlap and
lookups hit partly. `Verifier` counts what it checked and records each wrong or lost block.
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from cache_service.client.answers import Match, Payload
from cache_service.core.blocks import Namespace, key_hex
from cache_service.core.hashing import BlockHasher
from cache_service.core.tokens import tokens_to_bytes

HASHER = BlockHasher()  # the service's default seed: the tests' servers run with it


def payload_of(model: str, prefix_token_bytes: bytes, index: int, sizes: tuple[int, int]) -> bytes:
    """The payload of block `index`, whose prefix (blocks 0..index) is `prefix_token_bytes`."""
    digest = hashlib.blake2b(
        b"%s\0%d\0%s" % (model.encode(), index, prefix_token_bytes), digest_size=32
    ).digest()
    low, high = sizes
    size = low + int.from_bytes(digest[:4], "little") % (high - low + 1)
    return hashlib.shake_128(digest).digest(size)


class Prompt:
    """One prompt of a PromptSet: its tokens, its block keys and its blocks' payloads."""

    def __init__(
        self, name: str, model: str, tokens: list[int], block_size: int, sizes: tuple[int, int]
    ) -> None:
        self.name = name
        self.model = model
        self.tokens = tokens
        self.block_size = block_size
        self.blocks = len(tokens) // block_size
        self.sizes = sizes
        self._payloads: dict[int, bytes] = {}

    @cached_property
    def token_bytes(self) -> bytes:
        """The tokens as uint32 little-endian."""
        return tokens_to_bytes(self.tokens)

    @cached_property
    def keys(self) -> list[str]:
        """Every full block's key, as the API writes it (hex)."""
        namespace = Namespace(model=self.model)
        chain = HASHER.chain(namespace, self.token_bytes, block_size=self.block_size)
        return [key_hex(key) for key in chain.keys]

    def payload(self, index: int) -> bytes:
        """The payload of block `index` (memoized: threads may race to fill it, harmlessly)."""
        found = self._payloads.get(index)
        if found is None:
            end = (index + 1) * self.block_size * 4
            found = payload_of(self.model, self.token_bytes[:end], index, self.sizes)
            self._payloads[index] = found
        return found

    def payloads(self, start: int, end: int) -> list[bytes]:
        """Payloads of blocks start..end-1."""
        return [self.payload(index) for index in range(start, end)]


@dataclass(frozen=True)
class PromptSet:
    """`families` x `variants` prompts; a family's prompts share `shared_blocks` blocks."""

    model: str = "reliability-model"
    block_size: int = 16
    families: int = 64
    variants: int = 8
    shared_blocks: tuple[int, int] = (1, 4)
    tail_blocks: tuple[int, int] = (1, 6)
    payload_bytes: tuple[int, int] = (256, 2048)
    seed: int = 0
    _made: dict[tuple[int, int], Prompt] = field(default_factory=dict, compare=False, repr=False)

    def prompt(self, family: int, variant: int) -> Prompt:
        """Prompt `variant` of `family` (the same object every time)."""
        found = self._made.get((family, variant))
        if found is None:
            shared_rng = random.Random(f"{self.seed}/{family}")
            shared = shared_rng.randint(*self.shared_blocks) * self.block_size
            tail_rng = random.Random(f"{self.seed}/{family}/{variant}")
            tail = tail_rng.randint(*self.tail_blocks) * self.block_size
            tokens = [shared_rng.randrange(2**32) for _ in range(shared)]
            tokens += [tail_rng.randrange(2**32) for _ in range(tail)]
            name = f"{family}/{variant}"
            found = Prompt(name, self.model, tokens, self.block_size, self.payload_bytes)
            found = self._made.setdefault((family, variant), found)
        return found

    def pick(self, rng: random.Random) -> Prompt:
        """A prompt chosen at random."""
        return self.prompt(rng.randrange(self.families), rng.randrange(self.variants))

    def made(self) -> list[Prompt]:
        """Every prompt picked so far."""
        return list(self._made.values())


class Verifier:
    """Checks answers against the prompts' own payloads; thread-safe counts and findings.

    `wrong`: anything the service said that is false (a byte, a key, a hole before a present
    block). `lost`: a block that was acknowledged stored and is not found.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.checked_bytes = 0
        self.checked_blocks = 0
        self.wrong: list[str] = []
        self.lost: list[str] = []

    def _payloads(self, prompt: Prompt, payloads: Sequence[Payload | None]) -> tuple[int, int]:
        checked = blocks = 0
        for index, payload in enumerate(payloads):
            if payload is None:
                continue
            blocks += 1
            checked += len(payload)
            if bytes(payload) != prompt.payload(index):
                self._note(self.wrong, f"{prompt.name} block {index}: wrong bytes")
        return checked, blocks

    def _note(self, findings: list[str], message: str) -> None:
        with self._lock:
            findings.append(message)

    def _count(self, checked_bytes: int, blocks: int) -> None:
        with self._lock:
            self.checked_bytes += checked_bytes
            self.checked_blocks += blocks

    def check_match(self, prompt: Prompt, match: Match, *, at_least: int = 0) -> int:
        """Check a lookup's keys and payloads (if fetched); the blocks it matched."""
        matched = match.matched_blocks
        if matched > prompt.blocks or match.keys != prompt.keys[:matched]:
            self._note(self.wrong, f"{prompt.name}: lookup keys differ ({matched} matched)")
        if match.payloads is not None:
            if len(match.payloads) != matched:
                self._note(self.wrong, f"{prompt.name}: {len(match.payloads)} payloads")
            self._count(*self._payloads(prompt, match.payloads))
        if matched < at_least:
            self._note(self.lost, f"{prompt.name}: lookup matched {matched} of {at_least}")
        return matched

    def check_fetch(
        self, prompt: Prompt, payloads: Sequence[Payload | None], *, at_least: int = 0
    ) -> int:
        """Check a fetch by the prompt's keys from block 0: exact bytes and no hole before a
        present block (prefix-closed); the blocks found."""
        present = [index for index, payload in enumerate(payloads) if payload is not None]
        if present != list(range(len(present))):
            self._note(self.wrong, f"{prompt.name}: fetch has a hole: present {present}")
        self._count(*self._payloads(prompt, payloads))
        if len(present) < at_least:
            self._note(self.lost, f"{prompt.name}: fetch found {len(present)} of {at_least}")
        return len(present)
