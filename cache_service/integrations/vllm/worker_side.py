"""The connector's half in vLLM's worker: KV bytes between the service and the paged cache.

Loads run before the forward that needs them (synchronous) or, by default, on a loader thread
while vLLM holds the request back and runs the others (asynchronous: `load_async`, reported
by `finished_loads`, failed blocks before or with the request): every piece of a group is read
(from the store's files with the `local_reads` option on the service's host, otherwise in one
HTTP request for the step's keys), its header checked against the running layout, and its
KV copied once, from the view it came in, into the group's vLLM blocks, every layer, in the
backend's own byte layout. A group that is missing, refused or unreadable ends that request's
load there: its blocks and every later one are reported to vLLM (`take_failed_blocks`),
which recomputes them (`kv_load_failure_policy: recompute`), so what was copied into them
does not matter, and the request stores nothing in that step, since its forward attended to
blocks that were not loaded.

Stores never block the forward for the network: at the step's end the completed groups are
copied out of the paged cache (so vLLM may free or reuse the blocks at once) and queued; a
background thread sends them. The queue is bounded in bytes; what does not fit is dropped and
counted. One vLLM block's bytes are every layer's page of it in layer order, moved through
the page seam (`paged`), which takes every KV cache layout whose pages are single runs of
bytes; another is refused when the caches are registered, and the connector then only misses.
Caches in host memory are written and read in place (`paged.HostPages`); caches in GPU memory
through pinned staging buffers, ordered on CUDA streams after vLLM's own work
(`device_pages.DevicePages`), the copy out ending on the sender's thread.

Under tensor parallelism each rank's worker moves its own shard under its own namespace (the
plan carries every rank's keys); KV the same on every rank (MLA's latent) is stored by rank 0
alone and loaded by every rank.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from cache_service.client import CacheClient
from cache_service.client.base import FETCH_KEYS
from cache_service.core.engines.groups import BlockGroups
from cache_service.core.errors import ServiceError
from cache_service.integrations.kv_layout import BlockRefused
from cache_service.integrations.vllm.counters import Counters
from cache_service.integrations.vllm.device_pages import CudaStreams, DevicePages
from cache_service.integrations.vllm.layout import EngineLayout
from cache_service.integrations.vllm.notes import RateLimitedLog, connector_logger
from cache_service.integrations.vllm.paged import (
    Gathered,
    HostPages,
    Landing,
    PageCopy,
    PagesRefused,
    PageView,
    page_views,
)
from cache_service.integrations.vllm.plan import LoadTask, Namespace, StepPlan, StoreTask

logger = connector_logger(__name__)
NOTES = RateLimitedLog(logger)
DRAIN_SECONDS = 30.0  # at shutdown, queued stores get this long to finish


def page_copy(views: Sequence[PageView]) -> PageCopy:
    """The page copy for the views' device; paged.PagesRefused where there is none."""
    device = views[0].pages.device
    if device.type == "cpu":
        return HostPages(views)
    if device.type == "cuda":
        return DevicePages(views, CudaStreams(device))
    raise PagesRefused(f"no page copy for {device.type} tensors (host and CUDA memory only)")


@dataclass(slots=True)
class _Landed:
    """Which pieces of one fetch of a load task were written, and why any was refused."""

    task: LoadTask
    groups: BlockGroups
    start: int  # the fetch's first key, as an index into task.keys
    count: int  # its keys
    kv_layout: str  # this rank's namespace layout for the task
    landing: Landing  # where the task's pages are written before they land in the cache
    ok: list[bool] = field(init=False)
    refused: dict[int, BlockRefused] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ok = [False] * self.count

    def whole_groups(self) -> int:
        """The fetch's leading groups every piece of which was written."""
        pieces = self.groups.service_blocks
        for group in range(self.count // pieces):
            if not all(self.ok[group * pieces : (group + 1) * pieces]):
                return group
        return self.count // pieces

    def refusal_in(self, group: int) -> BlockRefused | None:
        """Why a piece of the fetch's `group` was refused, if one was."""
        pieces = range(group * self.groups.service_blocks, (group + 1) * self.groups.service_blocks)
        return next((self.refused[i] for i in pieces if i in self.refused), None)


@dataclass(frozen=True, slots=True)
class _QueuedStore:
    task: StoreTask
    groups: BlockGroups
    kv: torch.Tensor  # [groups, engine_blocks * layers * block bytes] uint8, copied out
    gathered: Gathered  # the copy out, which the sender waits for before reading kv


def by_request(tasks: Sequence[LoadTask]) -> dict[str, list[LoadTask]]:
    """Load tasks by request, in plan order: a request's tasks end as one (it is reported
    finished once, when all have)."""
    grouped: dict[str, list[LoadTask]] = {}
    for task in tasks:
        grouped.setdefault(task.request_id, []).append(task)
    return grouped


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
        rank: int = 0,
        copier: Callable[[Sequence[PageView]], PageCopy] = page_copy,
    ) -> None:
        self.layout = layout.for_rank(rank)
        self.rank = rank
        # Replicated KV (MLA) is the same on every rank: rank 0 stores it, every rank loads.
        self.stores = rank == 0 or not layout.tp_replicated
        self.client = client  # loads, on the forward's thread or the loader's
        self.store_client = store_client  # stores, on the sender's thread (failures its own)
        self.counters = counters
        self.store_queue_bytes = store_queue_bytes
        self.store_request_bytes = store_request_bytes
        self._copier = copier  # the page copy for the caches' device (`page_copy`, above)
        self._pages: PageCopy | None = None  # the paged cache, once registered
        self.refusal = "vLLM registered no KV cache"  # why the caches were not taken, or ""
        self._failed_blocks: set[int] = set()
        self._queue: queue.Queue[_QueuedStore | None] = queue.Queue()
        self._queued_bytes = 0
        self._queued_lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        # Asynchronous loads: one thread, so a request's load never races another's for the
        # service or the CPU; finished ones wait in _loaded for vLLM's next get_finished.
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompt-cache-load")
        self._loaded: dict[str, list[int]] = {}
        self._loaded_lock = threading.Lock()
        self._sender = threading.Thread(target=self._send_loop, name="prompt-cache-store")
        self._sender.daemon = True
        self._sender.start()

    def register(self, kv_caches: Mapping[str, torch.Tensor], *, num_blocks: int) -> None:
        """Take vLLM's per-layer caches of `num_blocks` vLLM blocks; refuse (log, then only
        miss) a layout the page seam cannot copy (`paged`)."""
        try:
            pages = self._copier(
                page_views(
                    kv_caches, num_blocks=num_blocks, layout_name=self.layout.kv_cache_layout
                )
            )
            problem = ""
            if pages.layers != self.layout.layers:
                problem = f"{pages.layers} distinct layers, the model has {self.layout.layers}"
            elif pages.page_bytes * pages.layers != self.layout.block_bytes:
                problem = (
                    f"a block is {pages.page_bytes * pages.layers} bytes across the layers, "
                    f"the layout says {self.layout.block_bytes}"
                )
        except PagesRefused as exc:
            problem = str(exc)
        self.refusal = problem
        if problem:
            logger.error("prompt cache connector disabled: vLLM's KV cache: %s", problem)
            return
        self._pages = pages

    @property
    def enabled(self) -> bool:
        """Whether the caches were registered and understood."""
        return self._pages is not None

    # Loads -------------------------------------------------------------------------------

    def load(self, plan: StepPlan) -> set[str]:
        """Write the plan's loads into the paged cache now (synchronous loads); the ids of
        requests whose load failed, whose blocks `take_failed_blocks` reports."""
        failed: set[str] = set()
        if not plan.loads:
            return failed
        groups = BlockGroups(self.layout.engine_block_tokens, plan.service_block_tokens)
        for request_id, tasks in by_request(plan.loads).items():
            missed = self._load_request(tasks, groups)
            if missed:
                failed.add(request_id)
                self._failed_blocks.update(missed)
        return failed

    def load_async(self, plan: StepPlan) -> None:
        """Start the plan's loads on the loader thread (asynchronous loads): vLLM holds each
        request back until `finished_loads` names it."""
        if not plan.loads:
            return
        groups = BlockGroups(self.layout.engine_block_tokens, plan.service_block_tokens)
        # On a GPU the loads' copies must follow what vLLM queued so far (the zeroing of the
        # new blocks): a mark on its stream, taken here on its thread.
        after = self._pages.mark() if self._pages is not None else None
        for request_id, tasks in by_request(plan.loads).items():
            self._loader.submit(self._load_in_background, request_id, tasks, groups, after)

    def _load_in_background(
        self, request_id: str, tasks: list[LoadTask], groups: BlockGroups, after: Any
    ) -> None:
        missed = [block for task in tasks for block in task.block_ids]  # until loaded
        try:
            missed = self._load_request(tasks, groups, after=after)
        finally:  # every load is reported, or vLLM would hold its request and blocks forever
            with self._loaded_lock:
                self._loaded[request_id] = missed

    def _load_request(
        self, tasks: list[LoadTask], groups: BlockGroups, *, after: Any = None
    ) -> list[int]:
        """Load one request's tasks in order (its whole groups, then a partial last group
        apart); once one falls short, the later ones are not loaded: vLLM recomputes from the
        first block missed. The block ids that could not be loaded."""
        missed: list[int] = []
        for task in tasks:
            if missed:
                self.counters.miss("load_failed", len(task.block_ids))
                missed += task.block_ids
            else:
                missed = self._load_one(task, groups, after=after)
        return missed

    def finished_loads(self) -> set[str]:
        """Requests whose asynchronous load ended since the last call; the blocks of those
        that failed go to `take_failed_blocks` first, as vLLM wants them no later than this."""
        with self._loaded_lock:
            loaded, self._loaded = self._loaded, {}
        for missed in loaded.values():
            self._failed_blocks.update(missed)
        return set(loaded)

    def _load_one(self, task: LoadTask, groups: BlockGroups, *, after: Any = None) -> list[int]:
        """Load one task's blocks (a GPU copy after the mark `after`, or on vLLM's stream),
        counting; the block ids that could not be loaded."""
        started = time.perf_counter()
        written = [0]  # vLLM blocks written so far, kept when the task fails part way
        reason = "load_failed"
        if self._pages is not None:
            landing = self._pages.landing(task.block_ids, after=after)
            try:
                self._load_task(task, groups, written, landing)
            except Exception as exc:  # a cache problem is a miss, never a failed step
                reason = "load_error"
                NOTES.warn(f"prompt cache load failed: {exc!r:.300}")
            try:
                landing.land(written[0])  # the blocks written before any failure
            except Exception as exc:
                written[0], reason = 0, "load_error"
                NOTES.warn(f"prompt cache load not copied to the cache: {exc!r:.300}")
        wanted = len(task.block_ids)
        if written[0] < wanted:
            self.counters.miss(reason, wanted - written[0])
        self.counters.add("loaded_blocks", written[0])
        self.counters.add("loaded_bytes", written[0] * self.layout.block_bytes)
        self.counters.add("load_seconds", time.perf_counter() - started)
        return list(task.block_ids[written[0] :])

    def _load_task(
        self, task: LoadTask, groups: BlockGroups, written: list[int], landing: Landing
    ) -> None:
        """Write the task's vLLM blocks in order, up to the first group that cannot be."""
        pieces = groups.service_blocks
        per_fetch = max(1, FETCH_KEYS // pieces) * pieces
        all_keys = task.keys_of(self.rank)
        kv_layout = self._kv_layout(task.namespace)
        for start in range(0, len(all_keys), per_fetch):
            keys = all_keys[start : start + per_fetch]
            landed = _Landed(task, groups, start, len(keys), kv_layout, landing)
            self.client.read_blocks(
                task.namespace.model, keys, partial(self._write_piece, landed),
                kv_layout=kv_layout, salt=task.namespace.salt,
            )  # fmt: skip
            whole = landed.whole_groups()
            end = (start // pieces + whole) * groups.engine_blocks - task.skip
            written[0] = min(len(task.block_ids), max(0, end))
            if whole < len(keys) // pieces:
                refusal = landed.refusal_in(whole)
                if refusal is not None:
                    self.counters.miss(f"refused_{refusal.field}")
                    NOTES.warn(f"prompt cache block refused ({refusal.field}): {refusal}")
                return

    def _write_piece(self, landed: _Landed, index: int, payload: bytes | memoryview | None) -> None:
        """Check one piece's header and copy its KV into the paged cache: the blocks of its
        group that vLLM does not already hold, every layer, straight from `payload` (a view
        into the store's map or the answer: the one copy of these bytes)."""
        if payload is None:  # evicted or purged since the lookup
            return
        groups, task = landed.groups, landed.task
        piece = index % groups.service_blocks
        piece_bytes = groups.piece_bytes(self.layout.block_bytes)
        try:
            offset = self.layout.check_piece(
                payload,
                piece=piece,
                pieces=groups.service_blocks,
                kv_bytes=piece_bytes,
                kv_layout=landed.kv_layout,
            )
        except BlockRefused as refusal:
            landed.refused[index] = refusal
            return
        data = np.frombuffer(payload, dtype=np.uint8, offset=offset)
        group = (landed.start + index) // groups.service_blocks
        first = group * groups.engine_blocks - task.skip  # block_ids index of its first block
        pages = self._pages
        assert pages is not None
        page_bytes, layers = pages.page_bytes, pages.layers
        landing = landed.landing
        done, at = 0, piece * piece_bytes  # where this piece starts in its group's bytes
        while done < len(data):  # the group's bytes: [engine blocks, layers, page bytes]
            unit, skip_bytes = divmod(at + done, page_bytes)
            position, layer = divmod(unit, layers)
            count = min(page_bytes - skip_bytes, len(data) - done)
            # Not one of the first group's blocks vLLM holds, nor past a prompt's last block
            # (a partial last group's, handoff.py)
            if 0 <= first + position < len(task.block_ids):
                block_id = task.block_ids[first + position]
                landing.write(layer, block_id, skip_bytes, data[done : done + count])
            done += count
        landed.ok[index] = True

    def _kv_layout(self, namespace: Namespace) -> str:
        """This rank's namespace layout for a request (the scheduler names rank 0's)."""
        if self.layout.tp_rank == 0:
            return namespace.kv_layout
        return self.layout.for_lora(namespace.lora).namespace_name

    def take_failed_blocks(self) -> set[int]:
        """vLLM block ids whose load failed since the last call (vLLM recomputes them)."""
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # Stores ------------------------------------------------------------------------------

    def save(self, plan: StepPlan, *, skip: bool) -> None:
        """Copy the plan's completed groups out of the paged cache and queue their stores;
        with `skip` (a load failed in this step) store nothing: vLLM recomputes every request
        that read a block that was not loaded, and the step's KV of those is not theirs."""
        if skip:
            self.counters.miss("store_skipped", sum(len(task.block_ids) for task in plan.stores))
            return
        if not plan.stores or self._pages is None or not self.stores:
            return
        groups = BlockGroups(self.layout.engine_block_tokens, plan.service_block_tokens)
        for task in plan.stores:
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
            try:
                # Copied out in vLLM's stream order now: vLLM may reuse the blocks next.
                gathered = self._pages.gather(task.block_ids)
                kv = gathered.kv.view(-1, groups.engine_blocks * gathered.kv.shape[1])
                self._queue.put(_QueuedStore(task, groups, kv, gathered))
            except Exception as exc:  # never fail the step: these blocks are just not stored
                self._release(size)
                self.counters.miss("store_error", len(task.block_ids))
                NOTES.warn(f"prompt cache store not queued: {exc!r:.300}")
            self.counters.add("store_seconds", time.perf_counter() - started)

    def _release(self, size: int) -> None:
        with self._queued_lock:
            self._queued_bytes -= size
            if self._queue.empty() and self._queued_bytes <= 0:
                self._idle.set()

    def _send_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            started = time.perf_counter()
            try:
                self._send(item)
            except Exception as exc:  # a store that fails only loses blocks; never the engine
                self.counters.miss("store_error", len(item.task.block_ids))
                NOTES.warn(f"prompt cache store failed: {exc!r:.300}")
            finally:
                self._release(len(item.task.block_ids) * self.layout.block_bytes)
                self.counters.add("store_seconds", time.perf_counter() - started)

    def _send(self, item: _QueuedStore) -> None:
        item.gathered.wait()  # a GPU's copy out ends here, on this thread, not vLLM's
        task, groups = item.task, item.groups
        ns = task.namespace
        kv_layout = self._kv_layout(ns)
        per_request = max(1, self.store_request_bytes // max(1, item.kv[0].numel()))
        total = item.kv.shape[0]
        for start in range(0, total, per_request):
            end = min(start + per_request, total)
            payloads: list[bytes] = []
            for row in range(start, end):
                pieces = groups.cut(item.kv[row].numpy().data)
                payloads += [
                    self.layout.header(piece=i, pieces=groups.service_blocks, kv_layout=kv_layout)
                    + piece
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
                    kv_layout=kv_layout,
                    start_block=first_group * groups.service_blocks,
                    salt=ns.salt,
                    retention=ns.retention or None,
                    block_size=groups.service_block_tokens,
                )
            except ServiceError as exc:  # a 4xx: e.g. the prefix was evicted since the lookup
                self.counters.miss("store_failed", (total - start) * groups.engine_blocks)
                NOTES.warn(f"prompt cache store refused ({exc}); blocks not stored")
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
        self._loader.shutdown(wait=True, cancel_futures=True)
        if not self.wait_idle(DRAIN_SECONDS):
            logger.warning("prompt cache: stores still queued at shutdown were dropped")
        self._queue.put(None)
