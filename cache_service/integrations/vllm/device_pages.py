"""The page copy for vLLM's paged KV cache in GPU memory: pinned staging, ordered on streams.

Written to vLLM 0.32's own ordering rules (its offloading workers, `gpu_worker.py` and
`simple_kv_offload/worker.py`), and not yet run on a GPU engine:

- **Loads** are written piece by piece into a pinned host buffer laid out `[blocks, layers,
  page]` (a group's own byte order), then copied in one host-to-device copy per chunk and put
  in place with one `index_copy_` per layer. A synchronous load is queued on vLLM's current
  stream, so it follows the zeroing of freshly allocated blocks and precedes the forward
  without a host sync. An asynchronous one runs on a load stream that first waits for a mark
  taken on vLLM's stream when the load was started, and `land` returns once the copy ended,
  so a request is reported loaded only with its pages in place.
- **Stores** gather each block's pages with one `index_select` per layer on vLLM's current
  stream, after the forward that wrote them and before any later step can reuse the blocks;
  the device-to-host copy into pinned memory runs on a store stream that waits for the
  gather, and the sender thread waits for its end event (`Gathered.wait`), never vLLM's
  thread.
- Index tensors are built in pinned memory and copied without blocking, so neither `gather`
  nor the start of a load makes the host wait for the GPU.
- The temporary device tensors of one copy are bounded by `CHUNK_BYTES`, so a long prompt's
  store does not ask vLLM's nearly full GPU for its whole size at once.

`Unstreamed` runs the same staging with host tensors and no streams, in order: the tests
check this module's bytes with it on machines without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, Protocol

import numpy as np
import torch

from cache_service.integrations.vllm.paged import Gathered, PageView, wide

CHUNK_BYTES = 64 << 20  # device bytes one copy step holds at most beside vLLM's cache


class Streams(Protocol):
    """Host buffers and the ordering of copies on one device."""

    def host(self, shape: tuple[int, ...]) -> torch.Tensor:
        """An uninitialised uint8 host buffer the device can copy to and from without a sync."""

    def index(self, ids: Sequence[int]) -> torch.Tensor:
        """`ids` as a long tensor on the device, queued on the current stream."""

    def mark(self) -> Any:
        """An event recorded now on the current stream."""

    def side(self, name: str, after: Any) -> Any:
        """A context in which the current stream is the side stream `name`, after `after`."""

    def keep(self, tensor: torch.Tensor, name: str) -> None:
        """Keep `tensor`'s memory from reuse until the side stream `name` is past its use."""


class CudaStreams:
    """CUDA streams and pinned memory; a load stream and a store stream of the copy's own."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # torch.cuda.Stream and Event are untyped
        self._side = {
            "load": torch.cuda.Stream(device),  # type: ignore[no-untyped-call]
            "store": torch.cuda.Stream(device),  # type: ignore[no-untyped-call]
        }

    def host(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Pinned host memory (torch's caching host allocator: reused, not re-pinned)."""
        return torch.empty(shape, dtype=torch.uint8, pin_memory=True)

    def index(self, ids: Sequence[int]) -> torch.Tensor:
        """From pinned memory, without blocking: a pageable source would sync the host."""
        pinned = torch.tensor(list(ids), dtype=torch.long).pin_memory()
        return pinned.to(self.device, non_blocking=True)

    def mark(self) -> torch.cuda.Event:
        """An event on the current stream."""
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextmanager
    def side(self, name: str, after: Any) -> Iterator[None]:
        """The side stream `name`, made to wait for `after` on the device (not the host)."""
        stream = self._side[name]
        stream.wait_event(after)
        with torch.cuda.stream(stream):
            yield

    def keep(self, tensor: torch.Tensor, name: str) -> None:
        """The caching allocator frees `tensor` only after the side stream's queued use."""
        tensor.record_stream(self._side[name])


class Unstreamed:
    """The same copies on host tensors, in call order: the staging path without a GPU."""

    device = torch.device("cpu")

    def host(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Plain host memory."""
        return torch.empty(shape, dtype=torch.uint8)

    def index(self, ids: Sequence[int]) -> torch.Tensor:
        """A host long tensor."""
        return torch.tensor(list(ids), dtype=torch.long)

    def mark(self) -> None:
        """Nothing to order: every copy has happened when it returns."""
        return None

    def side(self, name: str, after: Any) -> Any:
        """The caller's own thread and order."""
        return nullcontext()

    def keep(self, tensor: torch.Tensor, name: str) -> None:
        """Nothing runs later."""


class DevicePages:
    """The copy for caches in device memory, through pinned staging buffers."""

    def __init__(
        self, views: Sequence[PageView], streams: Streams, *, chunk_bytes: int = CHUNK_BYTES
    ) -> None:
        self._bytes = [view.pages for view in views]
        self._pages = [wide(view.pages) for view in views]  # what the copies move: words
        self.device = self._bytes[0].device.type
        self.streams = streams
        self._chunk = max(1, chunk_bytes // (self.layers * self.page_bytes))  # blocks a step

    @property
    def layers(self) -> int:
        """Distinct layers."""
        return len(self._bytes)

    @property
    def page_bytes(self) -> int:
        """Bytes of one layer's page of one vLLM block."""
        return int(self._bytes[0].shape[1])

    def mark(self) -> Any:
        """A point on vLLM's current stream that an asynchronous load must follow."""
        return self.streams.mark()

    def landing(self, block_ids: Sequence[int], *, after: Any = None) -> StagedLoad:
        """A load into `block_ids`, staged in host memory until `land`."""
        return StagedLoad(self, block_ids, after)

    def gather(self, block_ids: Sequence[int]) -> Gathered:
        """The blocks' pages, gathered on vLLM's stream and copied to host memory on the
        store stream; `Gathered.wait` waits for that copy."""
        streams, count = self.streams, len(block_ids)
        host = streams.host((count, self.layers, self.page_bytes))
        ids = streams.index(block_ids)
        for start in range(0, count, self._chunk):
            part = ids[start : start + self._chunk]
            kv = torch.stack([pages.index_select(0, part) for pages in self._pages], dim=1)
            with streams.side("store", streams.mark()):
                host[start : start + len(part)].copy_(kv.view(torch.uint8), non_blocking=True)
            streams.keep(kv, "store")
        with streams.side("store", streams.mark()):
            done = streams.mark()
        return Gathered(host.view(count, -1), done)

    def put(self, staging: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Copy `staging`'s `[blocks, layers, page]` bytes into `block_ids`, on the current
        stream, one chunk of blocks at a time."""
        streams = self.streams
        ids = streams.index(block_ids)
        device = self._pages[0].device
        for start in range(0, len(block_ids), self._chunk):
            end = min(start + self._chunk, len(block_ids))
            pages = staging[start:end].to(device, non_blocking=True)
            words = pages.view(self._pages[0].dtype)  # as the caches' views: bytes or words
            for layer, cache in enumerate(self._pages):
                cache.index_copy_(0, ids[start:end], words[:, layer])


class StagedLoad:
    """One load's pages in a host buffer `[blocks, layers, page]`, put in the cache by `land`."""

    def __init__(self, pages: DevicePages, block_ids: Sequence[int], after: Any) -> None:
        self._pages = pages
        self._block_ids = list(block_ids)
        self._rows = {block_id: row for row, block_id in enumerate(self._block_ids)}
        self._after = after
        self._staging = pages.streams.host((len(block_ids), pages.layers, pages.page_bytes))
        self._array = self._staging.numpy()

    def write(self, layer: int, block_id: int, at: int, data: np.ndarray) -> None:
        """Copy `data` into the staged page of (`layer`, `block_id`), from byte `at`."""
        self._array[self._rows[block_id], layer, at : at + len(data)] = data

    def land(self, blocks: int) -> None:
        """Put the first `blocks` staged blocks in the cache: queued on vLLM's stream for a
        synchronous load; on the load stream, waited for here, for an asynchronous one."""
        if blocks <= 0:
            return
        streams = self._pages.streams
        if self._after is None:
            self._pages.put(self._staging[:blocks], self._block_ids[:blocks])
            return
        with streams.side("load", self._after):
            self._pages.put(self._staging[:blocks], self._block_ids[:blocks])
            done = streams.mark()
        if done is not None:
            done.synchronize()  # on the loader's thread: the request is reported loaded next
