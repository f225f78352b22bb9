"""The connector's half in vLLM's worker: KV bytes between the service and the paged cache.

Loads are synchronous, before the forward that needs them: every piece of a group is fetched
(one request for the step's keys), its header checked against the running layout, and the
group's vLLM blocks written, every layer, in the backend's own byte layout. A group that is
missing, refused or unreadable ends that request's load there: its blocks and every later
one are reported to vLLM (`take_failed_blocks`), which recomputes them
(`kv_load_failure_policy: recompute`), and the request stores nothing in that step, since its
forward attended to blocks that were not loaded.

Stores never block the forward for the network: at the step's end the completed groups are
copied out of the paged cache (so vLLM may free or reuse the blocks at once) and queued; a
background thread sends them. The queue is bounded in bytes; what does not fit is dropped and
counted. One vLLM block's bytes are every layer's `kv_cache[block]` in layer order, so this
half works for any backend whose per-layer cache has the blocks on its first dimension (the
CPU backend's `[blocks, kv_heads, block_size, 2 * head_size]`); another shape is refused when
the caches are registered, and the connector then only misses.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from cache_service.client import CacheClient
from cache_service.core.errors import ServiceError
from cache_service.integrations.kv_layout import BlockRefused
from cache_service.integrations.vllm.counters import Counters
from cache_service.integrations.vllm.groups import BlockGroups
from cache_service.integrations.vllm.layout import EngineLayout
from cache_service.integrations.vllm.plan import LoadTask, StepPlan, StoreTask

logger = logging.getLogger(__name__)
DRAIN_SECONDS = 30.0  # at shutdown, queued stores get this long to finish


@dataclass(frozen=True, slots=True)
class _QueuedStore:
    task: StoreTask
    groups: BlockGroups
    kv: torch.Tensor  # [groups, engine_blocks * layers * block bytes] uint8, copied out


class WorkerSide:
    """Loads and stores of one worker (one tensor-parallel rank)."""

    def __init__(
        self,
        *,
        layout: EngineLayout,
        client: CacheClient,
        store_client: CacheClient,
        counters: Counters,
        store_queue_bytes: int,
        store_request_bytes: int,
    ) -> None:
        self.layout = layout
        self.client = client  # loads, on the forward's thread
        self.store_client = store_client  # stores, on the sender's thread (failures its own)
        self.counters = counters
        self.store_queue_bytes = store_queue_bytes
        self.store_request_bytes = store_request_bytes
        self._layers: list[torch.Tensor] = []  # each layer's cache as [blocks, block bytes]
        self._failed_blocks: set[int] = set()
        self._queue: queue.Queue[_QueuedStore | None] = queue.Queue()
        self._queued_bytes = 0
        self._queued_lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._sender = threading.Thread(target=self._send_loop, name="prompt-cache-store")
        self._sender.daemon = True
        self._sender.start()

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Take vLLM's per-layer caches; refuse (log, then only miss) a layout not understood."""
        layers = list(kv_caches.values())
        block_bytes = sum(cache[0].numel() * cache.element_size() for cache in layers[:1])
        problem = ""
        if len(layers) != self.layout.layers:
            problem = f"{len(layers)} layers, the model has {self.layout.layers}"
        elif len({cache.shape[0] for cache in layers}) != 1 or not all(
            cache.is_contiguous() for cache in layers
        ):
            problem = "the layers' caches are not contiguous tensors with blocks first"
        elif block_bytes * len(layers) != self.layout.block_bytes:
            problem = (
                f"a block is {block_bytes * len(layers)} bytes across the layers, the "
                f"layout says {self.layout.block_bytes} (blocks are not on the first dimension)"
            )
        if problem:
            logger.error("prompt cache connector disabled: vLLM's KV cache: %s", problem)
            return
        self._layers = [cache.view(cache.shape[0], -1).view(torch.uint8) for cache in layers]

    @property
    def enabled(self) -> bool:
        """Whether the caches were registered and understood."""
        return bool(self._layers)

    # Loads -------------------------------------------------------------------------------

    def load(self, plan: StepPlan) -> set[str]:
        """Write the plan's loads into the paged cache; the ids of requests whose load failed."""
        failed: set[str] = set()
        if not plan.loads:
            return failed
        groups = BlockGroups(self.layout.engine_block_tokens, plan.service_block_tokens)
        for task in plan.loads:
            started = time.perf_counter()
            written = self._load_task(task, groups) if self.enabled else 0
            wanted = len(task.block_ids)
            if written < wanted:
                failed.add(task.request_id)
                self._failed_blocks.update(task.block_ids[written:])
                self.counters.miss("load_failed", wanted - written)
            self.counters.add("loaded_blocks", written)
            self.counters.add("loaded_bytes", written * self.layout.block_bytes)
            self.counters.add("load_seconds", time.perf_counter() - started)
        return failed

    def _load_task(self, task: LoadTask, groups: BlockGroups) -> int:
        """The vLLM blocks written, in order, up to the first group that could not be."""
        ns = task.namespace
        payloads = self.client.get_blocks(
            ns.model, task.keys, kv_layout=ns.kv_layout, salt=ns.salt, copy=False
        )
        piece_bytes = groups.piece_bytes(self.layout.block_bytes)
        written = 0
        for index in range(len(task.keys) // groups.service_blocks):
            pieces = payloads[index * groups.service_blocks : (index + 1) * groups.service_blocks]
            kv = self._checked_group(pieces, groups, piece_bytes)
            if kv is None:
                break
            blocks = kv.view(groups.engine_blocks, len(self._layers), -1)
            skip = task.skip if index == 0 else 0
            for position in range(skip, groups.engine_blocks):
                block_id = task.block_ids[written]
                for layer, cache in enumerate(self._layers):
                    cache[block_id].copy_(blocks[position, layer])
                written += 1
        return written

    def _checked_group(
        self, pieces: Sequence[bytes | memoryview | None], groups: BlockGroups, piece_bytes: int
    ) -> torch.Tensor | None:
        """A group's KV as one uint8 tensor, or None (counted) unless every piece checks out."""
        kv = bytearray()
        for piece, payload in enumerate(pieces):
            if payload is None:  # evicted or purged since the lookup
                return None
            try:
                offset = self.layout.check_piece(
                    payload, piece=piece, pieces=groups.service_blocks, kv_bytes=piece_bytes
                )
            except BlockRefused as refusal:
                self.counters.miss(f"refused_{refusal.field}")
                logger.warning("prompt cache block refused (%s): %s", refusal.field, refusal)
                return None
            kv += memoryview(payload)[offset:]
        return torch.frombuffer(kv, dtype=torch.uint8)

    def take_failed_blocks(self) -> set[int]:
        """vLLM block ids whose load failed since the last call (vLLM recomputes them)."""
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # Stores ------------------------------------------------------------------------------

    def save(self, plan: StepPlan, *, skip_requests: set[str]) -> None:
        """Copy the plan's completed groups out of the paged cache and queue their stores."""
        if not plan.stores or not self.enabled:
            return
        groups = BlockGroups(self.layout.engine_block_tokens, plan.service_block_tokens)
        for task in plan.stores:
            if task.request_id in skip_requests:
                continue
            started = time.perf_counter()
            size = len(task.block_ids) * self.layout.block_bytes
            with self._queued_lock:
                fits = self._queued_bytes + size <= self.store_queue_bytes
                if fits:
                    self._queued_bytes += size
                    self._idle.clear()
            if not fits:
                self.counters.add("dropped_blocks", len(task.block_ids))
                continue
            index = torch.tensor(task.block_ids, dtype=torch.long)
            # [blocks, layers, block bytes]: each block's layers end to end, copied out now
            kv = torch.stack([cache.index_select(0, index) for cache in self._layers], dim=1)
            self._queue.put(
                _QueuedStore(task, groups, kv.view(-1, groups.engine_blocks * kv[0].numel()))
            )
            self.counters.add("store_seconds", time.perf_counter() - started)

    def _send_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            started = time.perf_counter()
            try:
                self._send(item)
            except Exception:  # a store that fails only loses blocks; never the engine
                self.counters.miss("store_failed", len(item.task.block_ids))
                logger.exception("prompt cache store failed")
            finally:
                with self._queued_lock:
                    self._queued_bytes -= len(item.task.block_ids) * self.layout.block_bytes
                    if self._queue.empty() and self._queued_bytes <= 0:
                        self._idle.set()
                self.counters.add("store_seconds", time.perf_counter() - started)

    def _send(self, item: _QueuedStore) -> None:
        task, groups = item.task, item.groups
        ns = task.namespace
        per_request = max(1, self.store_request_bytes // max(1, item.kv[0].numel()))
        total = item.kv.shape[0]
        for start in range(0, total, per_request):
            end = min(start + per_request, total)
            payloads: list[bytes] = []
            for row in range(start, end):
                pieces = groups.cut(item.kv[row].numpy().data)
                payloads += [
                    self.layout.header(piece=i, pieces=groups.service_blocks) + piece
                    for i, piece in enumerate(pieces)
                ]
            first_group = task.first_group + start
            sent_blocks = (end - start) * groups.engine_blocks
            failures = self.store_client.failures.total
            try:
                answer = self.store_client.store(
                    ns.model,
                    task.tokens[: (task.first_group + end) * groups.group_tokens],
                    payloads,
                    kv_layout=ns.kv_layout,
                    start_block=first_group * groups.service_blocks,
                    salt=ns.salt,
                    retention=ns.retention or None,
                    block_size=groups.service_block_tokens,
                )
            except ServiceError as exc:  # a 4xx: e.g. the prefix was evicted since the lookup
                self.counters.miss("store_failed", (total - start) * groups.engine_blocks)
                logger.warning("prompt cache store refused (%s); blocks not stored", exc)
                return
            if self.store_client.failures.total > failures:  # down, slow: failed open
                self.counters.miss("store_failed", (total - start) * groups.engine_blocks)
                return
            new_pieces = answer.stored_blocks
            self.counters.add("stored_blocks", new_pieces * sent_blocks // len(payloads))
            self.counters.add("stored_bytes", new_pieces * len(payloads[0]))

    def wait_idle(self, timeout_seconds: float) -> bool:
        """Wait until every queued store was sent; whether it was in time."""
        return self._idle.wait(timeout_seconds)

    def shutdown(self) -> None:
        """Let queued stores finish (for at most DRAIN_SECONDS), then stop the sender."""
        if not self.wait_idle(DRAIN_SECONDS):
            logger.warning("prompt cache: stores still queued at shutdown were dropped")
        self._queue.put(None)
