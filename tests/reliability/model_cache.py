"""The independent model of a prefix cache that tests/reliability/test_model.py checks against:
plain dicts keyed by (namespace index, chain), no code shared with the package.

What the model knows exactly, and why:
- a block's expiry: a store sets now + TTL, or keeps a later one (an alive block stored again);
  a hit slides the expiry of the deepest hit block still stored to at least hit time + TTL
  and lifts its ancestors to it (a prefix lives as long as its deepest block); a pin makes it
  infinite; the last pin let go gives now + the longest TTL;
- which blocks are held: eviction order is the store's business (its LRU, with ties), so the
  model does not predict it; it drops exactly what the cache reports evicted, after checking
  the report is legal (only leaves, never a pinned block, "expired" only for a dead one);
- purges remove what they name (a tenant, a namespace, a prompt's last block and its subtree),
  pinned or not, expired or not; the pins ending in them go and let go of the blocks above;
- a crash loses the touches still waiting for a flush, and nothing else: every other write is
  an LMDB transaction committed before its call returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tests.reliability.model_chains import Chain, prefixes

Entry = tuple[int, Chain]  # (namespace index, chain)


@dataclass
class Held:
    """One block the store holds in the model."""

    expires_at: float
    pins: int = 0


@dataclass(frozen=True)
class Hit:
    """A lookup's verified hit on the prefixes `chains` of one namespace, to be touched."""

    namespace: int
    chains: tuple[Chain, ...]
    at: float
    ttl_seconds: float


@dataclass
class CacheModel:
    """The blocks a cache holds, its pins and its touches still waiting for a flush."""

    longest_ttl_seconds: float
    blocks: dict[Entry, Held] = field(default_factory=dict)
    pins: dict[Entry, int] = field(default_factory=dict)  # deepest entry -> blocks it holds
    pending: list[Hit] = field(default_factory=list)

    def alive(self, entry: Entry, now: float) -> bool:
        """Stored and not expired at `now`."""
        held = self.blocks.get(entry)
        return held is not None and now < held.expires_at

    def longest_alive(self, namespace: int, prompt: Chain, now: float) -> int:
        """How many leading blocks of a prompt a lookup must return."""
        length = 0
        while length < len(prompt) and self.alive((namespace, prompt[: length + 1]), now):
            length += 1
        return length

    def pinned_blocks(self) -> int:
        """How many held blocks some pin holds."""
        return sum(held.pins > 0 for held in self.blocks.values())

    def has_child(self, entry: Entry) -> bool:
        """Whether a held block lies directly under `entry`."""
        namespace, chain = entry
        return any(
            other[0] == namespace and len(other[1]) == len(chain) + 1 and other[1][:-1] == chain
            for other in self.blocks
        )

    # -- writes ---------------------------------------------------------------------------------

    def store(self, entry: Entry, now: float, ttl_seconds: float) -> bool:
        """A block stored at `now`; True if it was alive already (refreshed)."""
        expires_at = now + ttl_seconds
        if self.alive(entry, now):
            held = self.blocks[entry]
            held.expires_at = max(held.expires_at, expires_at)
            return True
        self.blocks[entry] = Held(expires_at)  # new, or an expired block replaced
        return False

    def touch(self, hit: Hit) -> None:
        """Apply a hit: the deepest of its blocks still held slides, its ancestors follow."""
        held_chains = [chain for chain in hit.chains if (hit.namespace, chain) in self.blocks]
        if not held_chains:
            return  # every block of the hit went since the lookup
        deepest = held_chains[-1]
        expires_at = hit.at + hit.ttl_seconds
        if expires_at <= self.blocks[(hit.namespace, deepest)].expires_at:
            return
        for chain in prefixes(deepest):
            held = self.blocks[(hit.namespace, chain)]
            held.expires_at = max(held.expires_at, expires_at)

    def pin(self, entry: Entry) -> bool:
        """Pin every block of `entry`'s prefix; False if that very pin exists already."""
        if entry in self.pins:
            return False
        namespace, chain = entry
        self.pins[entry] = len(chain)
        for prefix in prefixes(chain):
            held = self.blocks[(namespace, prefix)]
            held.pins += 1
            held.expires_at = math.inf
        return True

    def unpin(self, entry: Entry, now: float) -> int:
        """Release the pin ending at `entry`; how many blocks it held (0: no such pin)."""
        count = self.pins.pop(entry, 0)
        namespace, chain = entry
        for prefix in prefixes(chain)[:count]:
            self._let_go((namespace, prefix), now)
        return count

    def _let_go(self, entry: Entry, now: float) -> None:
        held = self.blocks.get(entry)
        if held is None:
            return
        held.pins = max(held.pins - 1, 0)
        if held.pins == 0:
            held.expires_at = now + self.longest_ttl_seconds

    def purge(self, doomed: set[Entry], now: float) -> int:
        """Remove `doomed`; the pins ending in it let go of the blocks above. Returns how many
        pins went."""
        released = 0
        for entry in sorted(doomed, key=lambda entry: -len(entry[1])):  # deepest first
            count = self.pins.pop(entry, 0)
            if count:
                released += 1
                namespace, chain = entry
                for prefix in prefixes(chain)[: count - 1]:
                    self._let_go((namespace, prefix), now)
        for entry in doomed:
            del self.blocks[entry]
        return released
