"""How a fleet's router picks the engine for a request, in the four ways fleets route.

- round-robin: engines in turn, blind to prompts and load;
- sticky: a session to one engine (the trace's `session`; a trace without sessions, such as
  Mooncake's, names a conversation by its start, which its turns share: see SESSION_BLOCKS);
- least-loaded: the engine that has computed the fewest tokens so far (prompt tokens it
  missed plus output). Requests are replayed one at a time, so there is no queue to measure;
  the work an engine has done stands in for the load it would carry;
- prefix-aware: the cache-aware policy of the SGLang and vLLM routers over the engines'
  own caches (the longest prefix each holds, as the service's `/v1/route` scores engines from
  their KV events): the engine with the longest hit when it covers more than
  CACHE_THRESHOLD of the prompt (ties to the least loaded), else the engine caching the
  fewest blocks. Their load override (the least loaded once the busiest runs far more
  requests than the idlest) needs requests running side by side, which a replay of one
  request at a time has not.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

import xxhash

from cache_service.tools.replay.engine_cache import EngineCache
from cache_service.tools.replay.traces import TraceRequest

ROUTINGS = ("round-robin", "sticky", "least-loaded", "prefix-aware")
CACHE_THRESHOLD = 0.3  # the routers' --cache-threshold default
# A trace without sessions names a conversation by the start its turns share: its first two
# hash ids (Mooncake's first is the system prompt all share), or its first 256 tokens.
SESSION_BLOCKS = 2
SESSION_TOKENS = 256


class Router(Protocol):
    """Picks an engine for each request and hears how much work it made."""

    def pick(self, request: TraceRequest, hashes: Sequence[Hashable], prompt_tokens: int) -> int:
        """The engine (an index) that serves `request`."""
        ...

    def served(self, engine: int, computed_tokens: int) -> None:
        """`engine` computed this many tokens for the request it was given."""
        ...


class _Load:
    """Tokens each engine has computed."""

    def __init__(self, engines: int) -> None:
        self.computed = [0] * engines

    def served(self, engine: int, computed_tokens: int) -> None:
        """Count an engine's work."""
        self.computed[engine] += computed_tokens

    def least_loaded(self, among: Sequence[int]) -> int:
        """The engine of `among` that has computed least (the first such)."""
        return min(among, key=lambda engine: self.computed[engine])


class RoundRobin(_Load):
    """Engines in turn."""

    def __init__(self, engines: int) -> None:
        super().__init__(engines)
        self._next = 0

    def pick(self, request: TraceRequest, hashes: Sequence[Hashable], prompt_tokens: int) -> int:
        """The next engine in turn."""
        engine = self._next
        self._next = (engine + 1) % len(self.computed)
        return engine


class Sticky(_Load):
    """A session to one engine, by a hash of its name."""

    def pick(self, request: TraceRequest, hashes: Sequence[Hashable], prompt_tokens: int) -> int:
        """The session's engine."""
        return xxhash.xxh3_64_intdigest(session_of(request)) % len(self.computed)


class LeastLoaded(_Load):
    """The engine that has computed least."""

    def pick(self, request: TraceRequest, hashes: Sequence[Hashable], prompt_tokens: int) -> int:
        """The least loaded engine."""
        return self.least_loaded(range(len(self.computed)))


class PrefixAware(_Load):
    """The engine with the longest hit when it is a large enough share of the prompt, else
    the engine caching least."""

    def __init__(self, engines: Sequence[EngineCache]) -> None:
        super().__init__(len(engines))
        self._engines = engines

    def pick(self, request: TraceRequest, hashes: Sequence[Hashable], prompt_tokens: int) -> int:
        """The longest hit over the threshold (then the least load), or the emptiest cache."""
        engines = self._engines
        hits = [engine.longest_hit(hashes, prompt_tokens) for engine in engines]
        best = max(hits)
        if best * engines[0].block_tokens > CACHE_THRESHOLD * prompt_tokens:
            return self.least_loaded([i for i, hit in enumerate(hits) if hit == best])
        return min(
            range(len(engines)), key=lambda i: (engines[i].cached_blocks(), self.computed[i])
        )


def session_of(request: TraceRequest) -> bytes:
    """The request's session: the trace's own, else its namespace and first blocks."""
    if request.session:
        return b"session:" + request.session.encode()
    head = f"{request.source}/{request.model}/{request.tenant}/{request.salt}/".encode()
    if request.hash_ids is not None:
        return head + repr(request.hash_ids[:SESSION_BLOCKS]).encode()
    assert request.tokens is not None
    return head + bytes(request.tokens[: SESSION_TOKENS * 4])


def make_router(name: str, engines: Sequence[EngineCache]) -> Router:
    """The router called `name` (one of ROUTINGS) over `engines`."""
    if name == "round-robin":
        return RoundRobin(len(engines))
    if name == "sticky":
        return Sticky(len(engines))
    if name == "least-loaded":
        return LeastLoaded(len(engines))
    if name == "prefix-aware":
        return PrefixAware(engines)
    raise ValueError(f"unknown routing {name!r} (known: {', '.join(ROUTINGS)})")
