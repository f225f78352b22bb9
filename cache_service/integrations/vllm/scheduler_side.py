"""The connector's half in vLLM's scheduler: one lookup per request, and each step's plan.

vLLM asks `matched_tokens` for a new (or preempted and resumed) request inside its scheduling
loop, perhaps more than once for the same request, so the lookup runs once per request, with
a short timeout, and its answer is kept until the request finishes. `allocated` then says
which vLLM blocks the loaded tokens go into; `plan_step` turns that, and the tokens each step
computes, into the step's loads and stores. Only whole groups (see `groups`) of the prompt
are loaded or stored, and only prompt tokens are stored: the blocks a chunked prefill has
completed, from the first group the service lacks.

The lookup runs on a thread of its own: vLLM's scheduler waits for it at most
`lookup_wait_seconds` when it first asks (a lookup takes a millisecond or two), and otherwise
hears "ask again later" (None) and schedules other requests meanwhile, so a slow service
never stalls the requests already running. Nothing here fails a request: a lookup that fails
is a miss (counted under `lookup_failed`), and a request the service cannot serve exactly
(multimodal inputs, prompt embeddings, whose token ids are placeholders) is passed over and
counted.

Prefill and decode on separate engines: a prefill engine's request (vLLM's
`do_remote_decode`) is answered with what this engine stored of its prompt (`finished`); a
decode engine given that report polls the service, on the lookup thread, until it holds those
tokens or `prefill_wait_seconds` pass, since the prefill engine's stores are sent in the
background and may land after its answer reached the proxy. A wait that runs out is a miss of
what did not arrive (`prefill_not_stored`), never a failed request. The prompt's partial last
group goes under a key only that decode can name (`handoff.py`); an asynchronous load then
takes the whole prompt, and vLLM computes only its last token again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from functools import partial
from typing import Any

from cache_service.client import CacheClient
from cache_service.core.engines.groups import BlockGroups
from cache_service.core.errors import InvalidAnswer, ServiceError
from cache_service.integrations.vllm.counters import Counters
from cache_service.integrations.vllm.handoff import (
    Held,
    poll,
    report,
    tail_load,
    tail_of,
    tail_store,
)
from cache_service.integrations.vllm.layout import EngineLayout
from cache_service.integrations.vllm.notes import RateLimitedLog, connector_logger
from cache_service.integrations.vllm.options import (
    ConnectorOptions,
    OptionError,
    RequestOptions,
)
from cache_service.integrations.vllm.plan import LoadTask, Namespace, StepPlan, StoreTask
from cache_service.integrations.vllm.requests import (
    HeldTail,
    PromptRequest,
    ScheduledRequest,
    Tracked,
)

logger = connector_logger(__name__)
NOTES = RateLimitedLog(logger)
# A group larger than this many times the larger block size makes short prompts miss.
LARGE_GROUP_FACTOR = 4
INFO_RETRY_SECONDS = 5.0  # while the service's block size is unknown, ask at most this often


class SchedulerSide:
    """Lookups and step plans for one engine; `role_load`/`role_store` follow kv_role."""

    def __init__(
        self,
        *,
        options: ConnectorOptions,
        layout: EngineLayout,
        client: CacheClient,
        counters: Counters,
        role_load: bool,
        role_store: bool,
    ) -> None:
        self.options = options
        self.layout = layout
        self.client = client
        self.counters = counters
        self.role_load = role_load
        self.role_store = role_store
        self._groups: BlockGroups | None = None
        self._handoff_retention = ""  # learnt with the service's block size
        self._tracked: dict[str, Tracked] = {}
        self._loads: list[LoadTask] = []
        self._info_retry_at = 0.0
        self._lookups = ThreadPoolExecutor(max_workers=2, thread_name_prefix="prompt-cache-lookup")
        self._pending: dict[str, Future[Tracked]] = {}
        self._loading: dict[str, set[int]] = {}  # the vLLM blocks each request's load writes

    @property
    def groups(self) -> BlockGroups | None:
        """The block grouping, once the service's block size for the model is known."""
        if self._groups is None and time.monotonic() >= self._info_retry_at:
            self._info_retry_at = time.monotonic() + INFO_RETRY_SECONDS
            size = self._service_block_size()
            if size:
                self._groups = BlockGroups(self.layout.engine_block_tokens, size)
                self._warn_if_large(self._groups)
        return self._groups

    def _service_block_size(self) -> int:
        """The service's block size for the model, or 0 while it cannot be learnt."""
        try:
            info = self.client.info()
            size = info.block_size_for(self.layout.model)
            if size < 1:
                raise ValueError(f"block size {size}")
            self._handoff_retention = self._handoff_class(info.retention.classes)
            return size
        except (InvalidAnswer, ValueError) as exc:  # before ServiceError, which InvalidAnswer is
            logger.warning("prompt cache at %s: /v1/info not understood: %s", self.options.url, exc)
        except ServiceError as exc:
            logger.warning("prompt cache at %s: no block size yet (%s)", self.options.url, exc)
        self.counters.miss("no_block_size")
        return 0

    def _handoff_class(self, classes: Iterable[str]) -> str:
        """The class of a prompt's partial last group: the option's, where the service has it,
        else the request's ("")."""
        wanted = self.options.handoff_retention
        if not wanted or wanted in classes:
            return wanted
        if self.role_store:
            logger.warning(
                "prompt cache at %s has no retention class %r (handoff_retention): a prompt's "
                "partial last group, stored for its decode engine alone, takes the request's "
                "class and is kept as long. Add %s=10m to the service's --retention.",
                self.options.url,
                wanted,
                wanted,
            )
        return ""

    def _warn_if_large(self, groups: BlockGroups) -> None:
        larger = max(groups.engine_block_tokens, groups.service_block_tokens)
        if groups.group_tokens > LARGE_GROUP_FACTOR * larger:
            logger.warning(
                "vLLM's block size %d and the service's %d for model %r make groups of %d "
                "tokens: prompts shorter than that never hit. Start the service with "
                "--model-block-size '%s=%d' to match vLLM.",
                groups.engine_block_tokens,
                groups.service_block_tokens,
                self.layout.model,
                groups.group_tokens,
                self.layout.model,
                groups.engine_block_tokens,
            )

    def matched_tokens(self, request: PromptRequest, computed_tokens: int) -> int | None:
        """Tokens beyond vLLM's own `computed_tokens` that it can load from the service, or
        None while the request's lookup is still running (vLLM asks again next step)."""
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            pending = self._pending.get(request.request_id)
            wait = 0.0 if pending else self.options.lookup_wait_seconds
            if pending is None:
                pending = self._pending[request.request_id] = self._lookups.submit(
                    self._look_up, request
                )
            try:
                tracked = pending.result(timeout=wait)
            except FutureTimeout:
                return None
            del self._pending[request.request_id]
            self._tracked[request.request_id] = tracked
        groups = self.groups
        if groups is None or not (tracked.load and self.role_load):
            return 0
        loadable = groups.loadable_tokens(
            tracked.held_groups * groups.group_tokens,
            len(tracked.prompt_tokens),
            whole_prompt=self.options.load_mode == "async",
        )
        whole = groups.whole_groups(len(tracked.prompt_tokens)) * groups.group_tokens
        if tracked.tail is not None and loadable == whole:
            loadable += tracked.tail.tail.length  # only an asynchronous load finds a tail
        tracked.offered_from = computed_tokens
        return max(0, loadable - computed_tokens)

    def _look_up(self, request: PromptRequest) -> Tracked:
        """The request's namespace and what the service holds of it (never raises)."""
        try:
            return self._try_look_up(request)
        except Exception as exc:  # an answer of another shape, a bug: a miss, never a failure
            self.counters.miss("lookup_error")
            NOTES.warn(f"prompt cache lookup failed: {exc!r:.300}")
            return Tracked(
                Namespace(self.layout.model, self.layout.namespace_name, "", ""),
                request.prompt_tokens,
                load=False,
                store=False,
            )

    def _try_look_up(self, request: PromptRequest) -> Tracked:
        try:
            own = RequestOptions.from_params(request.kv_transfer_params)
        except OptionError as exc:
            self.counters.miss("bad_request_options")
            NOTES.warn(f"request {request.request_id}: {exc}; using the defaults")
            own = RequestOptions()
        namespace = Namespace(
            model=self.layout.model,
            kv_layout=self.layout.for_lora(request.lora).namespace_name,
            salt=request.cache_salt,
            retention=own.retention or self.options.retention,
            lora=request.lora,
        )
        tracked = Tracked(
            namespace,
            request.prompt_tokens,
            load=self.role_load and own.load,
            store=self.role_store and own.store,
            report=self.role_store and own.remote_decode,
        )
        passed_over = "multimodal" if request.multimodal else ""
        passed_over = "prompt_embeds" if request.prompt_embeds else passed_over
        if passed_over:  # token ids that do not say what the KV was computed from
            self.counters.miss(passed_over)
            tracked.load = tracked.store = tracked.report = False
            return tracked
        groups = self.groups
        if groups is None:
            return tracked
        deadline = time.monotonic() + self.options.prefill_wait_seconds
        if len(request.prompt_tokens) >= groups.group_tokens:
            held = self._held(request, namespace, groups)
            if tracked.load and own.stored_tokens:
                block = groups.service_block_tokens
                wanted = min(own.stored_tokens, len(request.prompt_tokens)) // block * block
                look = partial(self._held, request, namespace, groups)
                held = self._wait_for_prefill(request, look, wanted, held, deadline)
            if held is None:
                return tracked
            held_tokens, keys = held
            self.counters.add("lookups")
            self.counters.add("lookup_tokens", len(request.prompt_tokens))
            held_blocks = held_tokens // groups.service_block_tokens
            tracked.keys, tracked.rank_keys = keys[0], tuple(keys[1:])
            tracked.held_groups = held_blocks // groups.service_blocks
            tracked.stored_groups = tracked.held_groups
        whole = groups.whole_groups(len(request.prompt_tokens))
        if tracked.load and own.tail_nonce and tracked.held_groups == whole:
            tracked.tail = self._find_tail(request, namespace, groups, own, deadline)
        return tracked

    def _find_tail(
        self,
        request: PromptRequest,
        namespace: Namespace,
        groups: BlockGroups,
        own: RequestOptions,
        deadline: float,
    ) -> HeldTail | None:
        """The prompt's partial last group a prefill engine reported (`own`), if the service
        holds it (waiting for it until `deadline`); only an asynchronous load may take the
        last prompt token's group. A report of another length was of another prompt (a proxy
        changed it): its group is never stored under this prompt's name, so it is not waited
        for."""
        tail = tail_of(
            request.prompt_tokens,
            group_tokens=groups.group_tokens,
            nonce=own.tail_nonce,
            namespace=namespace,
            retention=self._handoff_retention,
        )
        if tail is None or self.options.load_mode != "async":
            return None
        if tail.length != own.tail_tokens:
            self.counters.miss("prefill_other_prompt")
            return None
        padded = replace(request, prompt_tokens=tail.tokens)
        look = partial(self._held, padded, tail.namespace, groups)
        held = self._wait_for_prefill(request, look, groups.group_tokens, look(), deadline)
        if held is None or held[0] < groups.group_tokens:
            return None
        return HeldTail(tail, held[1])

    def _held(
        self, request: PromptRequest, namespace: Namespace, groups: BlockGroups
    ) -> Held | None:
        """The tokens every rank's namespace holds, and each rank's keys; None when a lookup
        failed (counted)."""
        held_tokens, keys = len(request.prompt_tokens), []
        for rank in range(self.layout.ranks):  # with TP, every rank's shard must be held
            kv_layout = self.layout.for_rank(rank).for_lora(request.lora).namespace_name
            answer = self._look_up_rank(request, namespace, kv_layout, groups)
            if answer is None:
                return None
            held_tokens = min(held_tokens, answer[0])
            keys.append(answer[1])
        return held_tokens, keys

    def _wait_for_prefill(
        self,
        request: PromptRequest,
        look: Callable[[], Held | None],
        wanted: int,
        held: Held | None,
        deadline: float,
    ) -> Held | None:
        """`look` again until it finds the `wanted` tokens a prefill engine reported storing,
        or `deadline` passes; the last answer."""
        if held is not None and held[0] >= wanted:
            return held
        started = time.monotonic()
        self.counters.add("prefill_waits")
        held = poll(look, wanted, held, deadline)
        self.counters.add("prefill_wait_seconds", time.monotonic() - started)
        if held is None or held[0] < wanted:
            block = self._groups.service_block_tokens if self._groups else 1
            short = wanted - (held[0] if held is not None else 0)
            self.counters.miss("prefill_not_stored", -(-short // block))
            NOTES.warn(
                f"request {request.request_id}: what the prefill engine stored was not all in "
                f"the service after {self.options.prefill_wait_seconds} s: loading what is there"
            )
        return held

    def _look_up_rank(
        self, request: PromptRequest, namespace: Namespace, kv_layout: str, groups: BlockGroups
    ) -> tuple[int, list[str]] | None:
        """The tokens one rank's namespace holds (in whole keys the answer carries) and their
        keys; None when the lookup failed (counted)."""
        before = self.client.failures.total
        try:
            match = self.client.lookup(
                namespace.model,
                request.prompt_tokens,
                kv_layout=kv_layout,
                salt=namespace.salt,
                retention=namespace.retention or None,
                block_size=groups.service_block_tokens,
            )
        except ServiceError as exc:  # a 4xx: the service is up but refuses this lookup
            self.counters.miss("lookup_failed")
            NOTES.warn(f"prompt cache lookup refused ({exc}): a miss")
            return None
        if self.client.failures.total > before:  # failed open: down, slow, another service
            self.counters.miss("lookup_failed")
            return None
        # An answer short of keys holds less than it says
        held_blocks = min(match.cached_tokens // groups.service_block_tokens, len(match.keys))
        return held_blocks * groups.service_block_tokens, list(match.keys)

    def allocated(self, request_id: str, block_ids: list[int], external_tokens: int) -> None:
        """vLLM allocated `block_ids` (all the request's blocks); load `external_tokens`.
        A load is always planned for them: without keys it fails in the worker, and vLLM
        recomputes those blocks, rather than computing on blocks nobody wrote."""
        tracked = self._tracked.get(request_id)
        groups = self.groups
        if tracked is None or groups is None or external_tokens <= 0:
            return
        engine = groups.engine_block_tokens
        prompt = len(tracked.prompt_tokens)
        whole_tokens = groups.whole_groups(prompt) * groups.group_tokens
        end_tokens = tracked.offered_from + external_tokens
        tail = tracked.tail if end_tokens > whole_tokens else None
        first_block = tracked.offered_from // engine
        end_block = min(end_tokens, whole_tokens) // engine
        self.counters.add("hit_tokens", external_tokens)
        # What vLLM will hold once the load is done: if it computes from less (a failed load),
        # plan_step stores the groups it recomputes again.
        tracked.computed_tokens = end_tokens
        if end_block > first_block:
            first_group = first_block // groups.engine_blocks
            end_group = end_block // groups.engine_blocks
            wanted = groups.service_range(first_group, end_group)
            self._loads.append(
                LoadTask(
                    request_id=request_id,
                    namespace=tracked.namespace,
                    first_group=first_group,
                    keys=[tracked.keys[i] for i in wanted],
                    block_ids=list(block_ids[first_block:end_block]),
                    skip=first_block - first_group * groups.engine_blocks,
                    rank_keys=tuple([keys[i] for i in wanted] for keys in tracked.rank_keys),
                )
            )
        if tail is not None:  # the last group, under its own keys, to the prompt's end
            load = tail_load(
                request_id,
                tail.tail,
                tail.keys,
                block_ids,
                prompt_tokens=prompt,
                first_block=first_block,
                groups=groups,
            )
            self._loads.append(load)
            end_block = -(-prompt // engine)
        self._loading[request_id] = set(block_ids[first_block:end_block])

    def plan_step(self, scheduled: Iterable[ScheduledRequest]) -> StepPlan:
        """The step's loads (from `allocated`) and the stores of groups it completes."""
        groups = self.groups
        plan = StepPlan(service_block_tokens=groups.service_block_tokens if groups else 0)
        plan.loads, self._loads = self._loads, []
        for step in scheduled:
            tracked = self._tracked.get(step.request_id)
            if tracked is None:
                continue
            if step.new_block_ids is not None:
                if step.replaces_blocks:
                    tracked.block_ids = list(step.new_block_ids)
                else:
                    tracked.block_ids.extend(step.new_block_ids)
            if step.computed_tokens < tracked.computed_tokens:
                # vLLM recomputes from here (a failed load, a preemption): what was planned
                # past it was not computed from the tokens it holds now.
                tracked.stored_groups = min(
                    tracked.stored_groups, self._whole(step.computed_tokens)
                )
            tracked.computed_tokens = step.computed_tokens + step.scheduled_tokens
            if groups is not None and tracked.store and self.role_store:
                try:
                    tasks = [self._store_task(step.request_id, tracked, groups)]
                    if tracked.report:  # then a prefill engine's last group, for its decode
                        tasks.append(self._tail_task(step.request_id, tracked, groups))
                except Exception as exc:  # a miss: these blocks are just not stored
                    self.counters.miss("store_error")
                    NOTES.warn(f"prompt cache store not planned: {exc!r:.300}")
                    continue
                plan.stores += [task for task in tasks if task is not None]
        return plan

    def _whole(self, tokens: int) -> int:
        groups = self.groups
        return groups.whole_groups(tokens) if groups else 0

    def _store_task(
        self, request_id: str, tracked: Tracked, groups: BlockGroups
    ) -> StoreTask | None:
        done = groups.whole_groups(min(tracked.computed_tokens, len(tracked.prompt_tokens)))
        first = tracked.stored_groups
        blocks = groups.engine_range(first, done)
        if done <= first or blocks.stop > len(tracked.block_ids):
            return None
        tracked.stored_groups = done
        return StoreTask(
            request_id=request_id,
            namespace=tracked.namespace,
            first_group=first,
            tokens=tracked.prompt_tokens[: done * groups.group_tokens],
            block_ids=tracked.block_ids[blocks.start : blocks.stop],
        )

    def _tail_task(
        self, request_id: str, tracked: Tracked, groups: BlockGroups
    ) -> StoreTask | None:
        """A prefill engine's request, once its prompt is computed and every whole group
        stored: the store of its partial last group, for its decode engine alone."""
        prompt = tracked.prompt_tokens
        done = tracked.computed_tokens >= len(prompt)
        if (
            tracked.stored_tail is not None
            or not done
            or tracked.stored_groups < groups.whole_groups(len(prompt))
        ):
            return None
        store = tail_store(
            request_id,
            prompt,
            tracked.block_ids,
            groups,
            namespace=tracked.namespace,
            retention=self._handoff_retention,
        )
        if store is None:
            return None
        task, tracked.stored_tail = store
        return task

    def load_failed(self, block_ids: set[int]) -> None:
        """vLLM reports blocks whose load failed: their requests are offered nothing more.
        After a failed asynchronous load vLLM asks again for the same request; offering the
        same groups would fail the same way, and the request would never run."""
        for request_id, blocks in list(self._loading.items()):
            tracked = self._tracked.get(request_id)
            if blocks & block_ids and tracked is not None:
                tracked.held_groups = 0
                del self._loading[request_id]

    def finished(self, request_id: str) -> dict[str, Any] | None:
        """Forget a finished request; for a prefill engine's request, the `kv_transfer_params`
        its answer carries to the decode engine: the prompt tokens stored (or held)."""
        tracked = self._tracked.pop(request_id, None)
        self._pending.pop(request_id, None)
        self._loading.pop(request_id, None)
        groups = self._groups
        if tracked is None or not tracked.report or groups is None:
            return None
        stored = tracked.stored_groups * groups.group_tokens if tracked.store else 0
        tail = tracked.stored_tail
        if tail is None:
            return report(stored)
        return report(stored, tail_nonce=tail.nonce, tail_tokens=tail.length)

    def stop(self, reason: str) -> None:
        """Load and store nothing from now on (requests in flight included), saying why."""
        logger.error("PromptCacheConnector stops loading and storing: %s", reason)
        self.role_load = self.role_store = False
        for tracked in self._tracked.values():
            tracked.load = tracked.store = False
        for pending in self._pending.values():
            pending.cancel()
        self._pending.clear()

    def shutdown(self) -> None:
        """Stop the lookup threads."""
        self._lookups.shutdown(wait=False, cancel_futures=True)
