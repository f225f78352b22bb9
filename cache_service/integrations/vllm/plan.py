"""What the scheduler half tells the worker half each step: which blocks to load and store.

Plain data, pickled by vLLM when its workers run in other processes. Keys and the namespace
are worked out on the scheduler's side, since only it sees a request's `cache_salt`, LoRA
adapter and options; the worker only moves bytes between the service and the block ids.
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


@dataclass(frozen=True, slots=True)
class LoadTask:
    """Load groups first_group.. of a request into its vLLM blocks."""

    request_id: str
    namespace: Namespace
    first_group: int
    keys: list[str]  # the service keys of every piece of those groups, in order
    block_ids: list[int]  # the vLLM block to write each group's blocks into, after `skip`
    skip: int  # leading vLLM blocks of the first group vLLM already holds: not written


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
