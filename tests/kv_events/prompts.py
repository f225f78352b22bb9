"""The BlockStored events an engine publishes for a prompt, hashed with a scheme and seed.

The hashes come from the package's schemes, which tests/engines pins against golden vectors
of the engines' reference definitions and of vLLM 0.32 itself; here they only stand in for
an engine's hashes (with a seed and extra-keys form of the test's choosing, right or wrong).
A LoRA's adapter path is LORA_PATH unless given (vLLM 0.32 hashes it; events do not carry it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cache_service.core.engines.block_hashes import normalize_block_hash
from cache_service.core.engines.decoding import BlockStored, decode_batch
from cache_service.core.engines.schemes import scheme_named
from tests.kv_events.publisher import WIRES, encode_batch, stored

LORA_PATH = "/adapters/lora"  # the path every test LoRA was served from


def lora_modules(*names: str | None) -> tuple[tuple[str, str], ...]:
    """An engine's lora_modules serving `names` (each from LORA_PATH)."""
    return tuple(sorted({(name, LORA_PATH) for name in names if name is not None}))


def published_hashes(
    scheme_name: str,
    tokens: Sequence[int],
    *,
    seed: str | None,
    block_size: int = 16,
    int_hashes: bool = True,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    extra_keys_form: str = "tagged",
) -> list[int | bytes]:
    """A prompt's block hashes as the engine's events carry them: vLLM's digests folded to
    its default int form (or kept as bytes), SGLang's int64 and Dynamo's u64 as they are."""
    scheme = scheme_named(scheme_name, seed=seed, extra_keys_form=extra_keys_form)
    raw = scheme.block_hashes(
        tokens,
        block_size=block_size,
        lora_name=lora_name,
        lora_path=LORA_PATH,
        cache_salt=cache_salt,
    )
    return [
        value if isinstance(value, int) or not int_hashes else int(normalize_block_hash(value))
        for value in raw
    ]


def prompt_events(
    scheme_name: str,
    tokens: Sequence[int],
    *,
    seed: str | None,
    splits: Sequence[int] | None = None,
    block_size: int = 16,
    int_hashes: bool = True,
    lora_name: str | None = None,
    event_block_size: int | None = None,
    extra_keys_form: str = "tagged",
    **fields: Any,
) -> list[dict[str, Any]]:
    """The stored events of a prompt's full blocks: the first `splits[0]` blocks start the
    prompt, each next event chains on the previous one's last block (one event by default).
    `event_block_size` is what the events claim (the engine's real block size)."""
    hashes = published_hashes(
        scheme_name,
        tokens,
        seed=seed,
        block_size=block_size,
        int_hashes=int_hashes,
        lora_name=lora_name,
        extra_keys_form=extra_keys_form,
    )
    sizes = list(splits) if splits is not None else [len(hashes)]
    if sum(sizes) != len(hashes):
        raise ValueError(f"splits {sizes} do not cover {len(hashes)} blocks")
    events = []
    start = 0
    for size in sizes:
        events.append(
            stored(
                hashes[start : start + size],
                parent_block_hash=hashes[start - 1] if start else None,
                token_ids=list(tokens[start * block_size : (start + size) * block_size]),
                block_size=event_block_size or block_size,
                lora_name=lora_name,
                **fields,
            )
        )
        start += size
    return events


def decoded(events: list[dict[str, Any]], wire: str = "vllm-map-batch") -> list[BlockStored]:
    """The events as the subscriber gets them: encoded in a release's wire, decoded."""
    batch = decode_batch(encode_batch(WIRES[wire], events))
    return [event for event in batch.events if isinstance(event, BlockStored)]
