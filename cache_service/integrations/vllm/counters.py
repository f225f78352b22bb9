"""What the connector counts: hits, tokens and bytes moved, seconds spent, misses by reason.

Both halves of the connector (vLLM's scheduler and its worker) count into a `Counters`; vLLM
collects the counts made since its last collection (`take`) and, with stats logging on, logs
them and exports them to Prometheus (`prom.py`). `totals` keeps everything since start, for
an offline `LLM`, which turns stats logging off.

    lookups                  prompts looked up in the service
    lookup_tokens            their tokens
    hit_tokens               tokens vLLM took from the service (after its own prefix cache)
    loaded_blocks / bytes    vLLM blocks written into the paged cache, and their bytes
    load_seconds             fetching, checking and writing them
    stored_blocks / bytes    vLLM blocks the service newly took, and their bytes (headers too)
    store_seconds            copying out (on the forward's thread) and sending (in the back)
    engine_seconds           the connector's time on vLLM's own thread (the worker's loads
                             or their start, stores' copies out, reports): what it adds to a step
    dropped_blocks           blocks not stored because the store queue was full
    prefill_waits / seconds  lookups of a decode engine that waited for a prefill engine's
                             stores to reach the service, and the time they waited
    miss_<reason>            a cache problem turned into a miss: lookup_failed, load_failed,
                             store_failed, refused_<field>, multimodal, prompt_embeds,
                             bad_request_options, no_block_size, prefill_not_stored (blocks
                             a prefill engine reported that had not arrived in time),
                             prefill_other_prompt (a report whose last group is of another
                             length: another prompt's, not waited for)
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Mapping

COUNTERS = (
    "lookups",
    "lookup_tokens",
    "hit_tokens",
    "loaded_blocks",
    "loaded_bytes",
    "load_seconds",
    "stored_blocks",
    "stored_bytes",
    "store_seconds",
    "engine_seconds",
    "dropped_blocks",
    "prefill_waits",
    "prefill_wait_seconds",
)
MISS_PREFIX = "miss_"


class Counters:
    """Thread-safe counts, with the part not yet taken by vLLM's stats collection."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: defaultdict[str, float] = defaultdict(float)
        self._fresh: defaultdict[str, float] = defaultdict(float)

    def add(self, name: str, amount: float = 1) -> None:
        """Count `amount` more of `name`."""
        if not amount:
            return
        with self._lock:
            self._totals[name] += amount
            self._fresh[name] += amount

    def miss(self, reason: str, amount: float = 1) -> None:
        """Count a cache problem that became a miss, by reason."""
        self.add(MISS_PREFIX + reason, amount)

    def take(self) -> dict[str, float]:
        """The counts since the last take (and forget them)."""
        with self._lock:
            fresh, self._fresh = dict(self._fresh), defaultdict(float)
        return fresh

    def totals(self) -> dict[str, float]:
        """Every count since start."""
        with self._lock:
            return dict(self._totals)


def merged(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    """Two sets of counts added up."""
    total = defaultdict(float, a)
    for name, amount in b.items():
        total[name] += amount
    return dict(total)
