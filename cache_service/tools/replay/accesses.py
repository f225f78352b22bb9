"""The replay as a sequence of block accesses, for capacity curves and the offline optimum."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cache_service.core.hashing import BlockHasher
from cache_service.core.tokens import bytes_to_tokens
from cache_service.tools.replay.block_units import BlockUnits, request_namespace
from cache_service.tools.replay.traces import TraceRequest


@dataclass(frozen=True, slots=True)
class Accesses:
    """Per request, its trace blocks as small integers (head first), and what a hit is worth."""

    blocks: list[list[int]]
    input_lengths: list[int]
    block_tokens: int
    distinct: int

    def token_hits(self, request: int, hit_blocks: int) -> int:
        """Tokens a request hits with `hit_blocks` blocks, as the trace counts them."""
        return min(hit_blocks * self.block_tokens, self.input_lengths[request])


def build_accesses(requests: Sequence[TraceRequest], units: BlockUnits) -> Accesses:
    """Number every distinct trace block of the replay in order of first appearance.

    A hash id names a block together with its prefix, within its file and namespace; a token
    block is named by its chained key, so equal prefixes share numbers exactly as in the cache.
    """
    numbers: dict[object, int] = {}  # a block's name -> its number
    hasher = BlockHasher()
    blocks: list[list[int]] = []
    for request in requests:
        namespace = request_namespace(request)
        if request.hash_ids is not None:
            # Named by its whole prefix, as the cache's chained keys name it: an id that
            # follows another prefix is another block.
            path: list[int] = []
            parent: object = namespace
            for hash_id in request.hash_ids:
                parent = numbers.setdefault((parent, hash_id), len(numbers))
                path.append(parent)
            blocks.append(path)
        else:
            assert request.tokens is not None
            tokens = bytes_to_tokens(request.tokens)
            keys = hasher.keys(namespace, tokens, block_size=units.trace_tokens)
            blocks.append([numbers.setdefault(key, len(numbers)) for key in keys])
    return Accesses(
        blocks=blocks,
        input_lengths=[r.input_length for r in requests],
        block_tokens=units.trace_tokens,
        distinct=len(numbers),
    )
