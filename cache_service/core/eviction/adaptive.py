"""Adaptive protection: how long a reused block outlives a new one, learned from evictions.

`protected` gives a reused block one extra eviction horizon; whether that is too little or
too much depends on the traffic (on a trace of agent loops every block is reused and the
protection only reorders them; on one-off documents it is what keeps the hot prompts). This
policy learns the multiple m of the horizon online, from what the ghost sees: a block
evicted and asked for again soon after was evicted too early. If blocks that had been hit
come back more often, per eviction, than blocks that had not, reused blocks deserve more
time (m goes up one rung); if less often, less (m goes down). It starts at m = 0, which is
exactly LRU, and moves one rung per cache turnover (as many blocks stored as the cache
holds), only when the two rates differ by more than two standard deviations of their
counts: with no evidence it stays where it is. No constant is fitted to a trace: the rungs
double (scale-free), "recent" is one turnover (counts halve each turnover), and the noise
test is the usual two sigma.
"""

from __future__ import annotations

import math
from typing import Any

from cache_service.core.blocks import BlockMeta
from cache_service.core.eviction.protected import ProtectedPolicy

RUNGS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)  # multiples of the horizon; 0 is LRU
SIGMAS = 2.0  # how far apart the two rates must be, in standard deviations, to move


class AdaptivePolicy(ProtectedPolicy):
    """Protected LRU whose protection (m eviction horizons) is learned from ghost hits.
    Cost: O(1) per use and per eviction; memory: the ghost (as `protected`) and six
    counters."""

    name = "adaptive"

    def __init__(self) -> None:
        super().__init__()
        self.rung = 0
        self._ghost_hits = [0.0, 0.0]  # [not hit, hit] blocks stored again from the ghost
        self._evictions = [0.0, 0.0]  # [not hit, hit] blocks evicted
        self._stored = 0  # blocks stored since the last turnover
        self._held = 0  # blocks the store held at its last eviction: one turnover

    @property
    def multiple(self) -> float:
        """The current protection, in eviction horizons."""
        return RUNGS[self.rung]

    def protection(self, seq: int) -> int:
        """m eviction horizons."""
        return int(RUNGS[self.rung] * self.horizon(seq))

    def stored_once(self) -> None:
        """Count towards a turnover; at one, take a step and let old counts fade."""
        self._stored += 1
        if self._held and self._stored >= self._held:
            self._stored = 0
            self._step()

    def ghost_hit(self, was_hit: bool) -> None:
        """One more block of that kind evicted too early."""
        self._ghost_hits[was_hit] += 1

    def evicted(self, meta: BlockMeta, *, held_blocks: int) -> None:
        """Count the eviction by kind, then as `protected` does."""
        self._evictions[meta.hits > 0] += 1
        self._held = held_blocks
        super().evicted(meta, held_blocks=held_blocks)

    def _step(self) -> None:
        (new_back, reused_back), (new_out, reused_out) = self._ghost_hits, self._evictions
        if new_out >= 1 and reused_out >= 1:  # halved counts fade towards 0, never reach it
            new_rate, reused_rate = new_back / new_out, reused_back / reused_out
            # Poisson noise of each rate (one count added: no evidence is not certainty)
            noise = SIGMAS * math.sqrt(
                (new_back + 1) / new_out**2 + (reused_back + 1) / reused_out**2
            )
            if reused_rate - new_rate > noise:
                self.rung = min(self.rung + 1, len(RUNGS) - 1)
            elif new_rate - reused_rate > noise:
                self.rung = max(self.rung - 1, 0)
        self._ghost_hits = [count / 2 for count in self._ghost_hits]
        self._evictions = [count / 2 for count in self._evictions]

    def _state(self) -> Any:
        counts = (tuple(self._ghost_hits), tuple(self._evictions))
        return (super()._state(), self.rung, counts, self._stored, self._held)

    def _restore(self, state: Any) -> None:
        base, self.rung, (back, out), self._stored, self._held = state
        super()._restore(base)
        self._ghost_hits, self._evictions = list(back), list(out)
