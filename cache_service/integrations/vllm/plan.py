"""What the scheduler half tells the worker half each step: which blocks to load and store.

Plain data, pickled by vLLM when its workers run in other processes. Keys and the namespace
are worked out on the scheduler's side, since only it sees a request's `cache_salt`, LoRA
adapter and options; the worker only moves bytes between the service and the block ids. With
tensor parallelism each rank's shard of the KV sits under that rank's namespace (its layout
names the rank): the plan carries every rank's keys, and a worker names its own namespace
from the request's LoRA adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Namespace:
    """Where a request's blocks live in the service."""

    model: str
    kv_layout: str
    salt: str
    retention: str  # "" = the service's default
    lora: str = ""  # the request's LoRA adapter (name and path): part of every rank's layout


@dataclass(frozen=True, slots=True)
class LoadTask:
    """Load groups first_group.. of a request into its vLLM blocks."""

    request_id: str
    namespace: Namespace
    first_group: int
    keys: list[str]  # the service keys of every piece of those groups, in order (rank 0's)
    block_ids: list[int]  # the vLLM block to write each group's blocks into, after `skip`
    skip: int  # leading vLLM blocks of the first group vLLM already holds: not written
    rank_keys: tuple[list[str], ...] = ()  # ranks 1.. keys, where each rank has its own

    def keys_of(self, rank: int) -> list[str]:
        """The keys tensor-parallel rank `rank` loads."""
        return self.rank_keys[rank - 1] if rank and self.rank_keys else self.keys


@dataclass(frozen=True, slots=True)
class StoreTask:
    """Store groups first_group.. of a request's prompt from its vLLM blocks."""

    request_id: str
    namespace: Namespace
    first_group: int
    tokens: list[int]  # the prompt up to the end of the last group
    block_ids: list[int]  # the vLLM blocks of those groups, in order


@dataclass(slots=True)
class StepPlan:
    """One scheduler step's loads and stores."""

    service_block_tokens: int = 0  # 0 while the service's block size is unknown: do nothing
    loads: list[LoadTask] = field(default_factory=list)
    stores: list[StoreTask] = field(default_factory=list)
