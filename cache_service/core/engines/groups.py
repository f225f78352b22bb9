"""How vLLM's KV blocks map onto the service's blocks when their sizes differ.

The rule the vLLM connector loads and stores by, and the one the fleet replay predicts its
hits by (tools/replay/fleet.py): one home, so the replay cannot drift from the connector.

vLLM pages KV in blocks of `engine_block_tokens` (128 on the CPU backend by default); the
service keys prompts in blocks of its own size for the model (64 by default). Neither has to
change: the connector moves KV in **groups** of `lcm(engine, service)` tokens. A group is
`engine_blocks` whole vLLM blocks, their bytes laid end to end (each block: every layer's
block tensor in the backend's own layout, layer by layer), cut into `service_blocks` pieces of
equal length, piece i stored under the group's i-th service block key.

Why bytes cut evenly rather than KV sliced by token: the CPU kernels lay a block out by
instruction set (`vec` stores K transposed, `amx` packs tiles), so a token slice of a block is
a strided view that differs per kernel. Whole vLLM blocks are valid for any kernel of the same
layout, and vLLM can use only whole blocks anyway, so cutting finer would gain nothing. A
piece alone is never used: a group loads only when every one of its pieces is found and
verified, and a lookup that matched part of a group counts only the whole groups before it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockGroups:
    """The group arithmetic for one engine block size against one service block size."""

    engine_block_tokens: int
    service_block_tokens: int

    def __post_init__(self) -> None:
        if self.engine_block_tokens < 1 or self.service_block_tokens < 1:
            raise ValueError("block sizes are at least 1 token")

    @property
    def group_tokens(self) -> int:
        """Tokens in one group: the least common multiple of the two block sizes."""
        return math.lcm(self.engine_block_tokens, self.service_block_tokens)

    @property
    def engine_blocks(self) -> int:
        """vLLM blocks in one group."""
        return self.group_tokens // self.engine_block_tokens

    @property
    def service_blocks(self) -> int:
        """Service blocks (pieces) in one group."""
        return self.group_tokens // self.service_block_tokens

    def whole_groups(self, tokens: int) -> int:
        """Whole groups in a run of `tokens` tokens from the prompt's start."""
        return max(tokens, 0) // self.group_tokens

    def loadable_tokens(
        self, cached_tokens: int, prompt_tokens: int, *, whole_prompt: bool = False
    ) -> int:
        """Tokens vLLM can load of a prompt whose first `cached_tokens` the service holds:
        whole groups only, and never the last prompt token (vLLM computes at least one),
        unless `whole_prompt` (an asynchronous load: vLLM then recomputes the last token)."""
        usable = prompt_tokens if whole_prompt else prompt_tokens - 1
        return self.whole_groups(min(cached_tokens, usable)) * self.group_tokens

    def service_range(self, first_group: int, end_group: int) -> range:
        """The service block indexes of groups first_group..end_group-1."""
        return range(first_group * self.service_blocks, end_group * self.service_blocks)

    def engine_range(self, first_group: int, end_group: int) -> range:
        """The positions in a request's block table of groups first_group..end_group-1."""
        return range(first_group * self.engine_blocks, end_group * self.engine_blocks)

    def piece_bytes(self, engine_block_bytes: int) -> int:
        """Bytes of KV in one piece, given the bytes of one vLLM block (all layers)."""
        group_bytes = engine_block_bytes * self.engine_blocks
        if group_bytes % self.service_blocks:
            raise ValueError(
                f"a group of {group_bytes} bytes does not cut into {self.service_blocks} pieces"
            )
        return group_bytes // self.service_blocks

    def cut(self, group: bytes | memoryview) -> list[memoryview]:
        """A group's bytes cut into its `service_blocks` pieces, in order (views, no copy)."""
        view = memoryview(group).cast("B")
        size, rest = divmod(len(view), self.service_blocks)
        if rest:
            raise ValueError(f"{len(view)} bytes do not cut into {self.service_blocks} pieces")
        return [view[i * size : (i + 1) * size] for i in range(self.service_blocks)]

    def join(self, pieces: Sequence[bytes | memoryview]) -> bytes:
        """A group's bytes from its pieces in order."""
        if len(pieces) != self.service_blocks:
            raise ValueError(f"{len(pieces)} pieces given, a group has {self.service_blocks}")
        return b"".join(pieces)
