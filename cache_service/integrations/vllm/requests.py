"""What the scheduler half knows of a request: vLLM's request and step as plain data, and
what the connector looked up and planned for it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cache_service.integrations.vllm.handoff import Tail
from cache_service.integrations.vllm.plan import Namespace


@dataclass(frozen=True, slots=True)
class PromptRequest:
    """What the scheduler half needs of one vLLM request."""

    request_id: str
    prompt_tokens: list[int]
    cache_salt: str = ""
    lora: str = ""  # the adapter's name and path; "" without one
    kv_transfer_params: Mapping[str, Any] | None = None
    multimodal: bool = False
    prompt_embeds: bool = False


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request in a step: its blocks so far and the tokens computed by the step's end."""

    request_id: str
    new_block_ids: list[int] | None  # None: no new blocks this step
    replaces_blocks: bool  # a new or resumed request: new_block_ids are all its blocks
    computed_tokens: int  # computed before the step
    scheduled_tokens: int  # computed in the step


@dataclass(frozen=True, slots=True)
class HeldTail:
    """A prompt's partial last group the service holds for this request, and its keys."""

    tail: Tail
    keys: list[list[str]]  # per rank


@dataclass(slots=True)
class Tracked:
    """A request's lookup answer and what has been planned for it."""

    namespace: Namespace
    prompt_tokens: list[int]
    load: bool
    store: bool
    keys: list[str] = field(default_factory=list)
    rank_keys: tuple[list[str], ...] = ()  # ranks 1.. own keys, where each rank has its own
    held_groups: int = 0  # whole groups the service held at the lookup
    stored_groups: int = 0  # groups held or planned to be stored
    block_ids: list[int] = field(default_factory=list)
    offered_from: int = 0  # tokens vLLM held when it asked: the load starts there
    computed_tokens: int = 0
    report: bool = False  # a prefill engine's request: `finished` reports what was stored
    stored_tail: Tail | None = None  # a prefill engine's: its partial last group, once stored
    tail: HeldTail | None = None  # a decode engine's request: the last group the service holds
