"""What a vLLM engine's KV bytes must match to be reused, as a namespace and a piece header.

Bytes of a paged KV block are reusable only by an engine that would have written the very
same bytes: the same weights, KV dtype, layer count, KV heads, head size, device, attention
backend, KV cache layout (`LBNHC` interleaves heads inside a page where `LBHNC` keeps them
apart) and (on CPU) the kernel's instruction set, which decides the byte order inside a
block, the same vLLM block size, the same tensor-parallel size and rank, and the same LoRA
adapter. An MLA model's latent KV is the same on every rank (vLLM's `kv_tp_replicas`): its
namespace names no rank (`tp=replicated/N`), so every rank loads what rank 0 stored. It still
names the size: the latents are computed after tensor-parallel reductions, whose order, and
so whose rounding, changes with the size.
`EngineLayout.namespace_name` puts all of them in the namespace's `kv_layout`, so blocks of
another layout sit under other keys and are never found; every stored piece also carries them
in its header (`kv_layout.pack_header`), checked at load, for a writer that named its
namespace wrongly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import xxhash

from cache_service.integrations.kv_layout import check_header, pack_header

MAX_KV_LAYOUT_CHARS = 256  # the service's limit on a namespace's kv_layout


@dataclass(frozen=True, slots=True)
class EngineLayout:
    """The engine, model and block shape a piece of KV was computed for."""

    model: str  # the namespace's model name
    weights: str  # digest of the weights ("xxh3:<hex>") or the name the operator gave them
    engine_version: str  # vLLM's release: a kernel's packing may change between releases
    device: str  # where the paged cache lives: "cpu", "cuda"
    backend: str  # vLLM's attention backend, e.g. "CPU_ATTN", "CPU_MLA"
    kv_cache_layout: str  # vLLM's KVCacheLayout, e.g. "LBHNC"
    isa: str  # the CPU kernel's instruction set (amx, vec, vec16, neon, ...), "" on GPUs
    kv_dtype: str  # vLLM's cache dtype: the model's ("bfloat16") or a quantised one ("fp8_e4m3")
    layers: int
    kv_heads: int  # per tensor-parallel rank
    head_size: int
    engine_block_tokens: int
    block_bytes: int  # bytes of one vLLM block across every layer
    tp_rank: int = 0
    tp_size: int = 1
    tp_replicated: bool = False  # every rank holds the same KV (MLA): stored once, rank-free
    lora: str = ""  # the adapter's name and path, "" without one

    def for_rank(self, rank: int) -> EngineLayout:
        """The layout of tensor-parallel rank `rank` (the same for replicated KV)."""
        return self if self.tp_replicated else replace(self, tp_rank=rank)

    @property
    def ranks(self) -> int:
        """How many ranks' namespaces hold a block's KV: 1 for replicated KV."""
        return 1 if self.tp_replicated else self.tp_size

    def for_lora(self, lora: str) -> EngineLayout:
        """The same layout under a LoRA adapter (another namespace: its KV differs)."""
        return replace(self, lora=lora)

    @property
    def namespace_name(self) -> str:
        """The namespace's kv_layout: every field but the model name (the namespace has it)."""
        text = (
            f"vllm-{self.engine_version};{self.device}:{self.backend};{self.kv_cache_layout};"
            f"isa={self.isa or '-'};{self.kv_dtype};"
            f"layers={self.layers};"
            f"kv_heads={self.kv_heads};head_size={self.head_size};"
            f"block={self.engine_block_tokens};bytes={self.block_bytes};"
            f"tp={'replicated' if self.tp_replicated else self.tp_rank}/{self.tp_size};"
            f"{self.weights}"
        )
        if self.lora:
            text += ";lora=" + xxhash.xxh3_64_hexdigest(self.lora.encode())
        if len(text) > MAX_KV_LAYOUT_CHARS:
            raise ValueError(f"kv_layout is {len(text)} characters: name the weights shorter")
        return text

    def header_fields(self, *, piece: int, pieces: int, kv_layout: str) -> dict[str, Any]:
        """The fields a piece's header carries: the layout, the request's namespace layout
        (with its LoRA adapter) and the piece's place in its group."""
        fields = {**asdict(self), "engine": "vllm", "kv_layout": kv_layout}
        return {**fields, "piece": piece, "pieces": pieces}

    def header(self, *, piece: int, pieces: int, kv_layout: str) -> bytes:
        """The header of piece `piece` of a group of `pieces`, stored under `kv_layout`."""
        return pack_header(self.header_fields(piece=piece, pieces=pieces, kv_layout=kv_layout))

    def check_piece(
        self,
        payload: bytes | memoryview,
        *,
        piece: int,
        pieces: int,
        kv_bytes: int,
        kv_layout: str,
    ) -> int:
        """The offset of a piece's KV; kv_layout.BlockRefused unless it is this layout's, for
        the namespace layout `kv_layout`, this place's piece, with `kv_bytes` of KV."""
        expected = self.header_fields(piece=piece, pieces=pieces, kv_layout=kv_layout)
        return check_header(payload, expected, kv_bytes=kv_bytes)
