"""The reference prefill worker: reuse the cached start of a prompt, compute only the rest.

For each prompt: one lookup with `fetch=True` (the longest cached prefix and its payloads in
one round trip); each block's header checked against the running model (a block that does not
match is refused, counted by the field that differs, and it and every later block are
computed instead); the model's KV cache rebuilt from the blocks; the model run on the
remaining tokens only; the new full blocks stored. The cache is an optimisation, never a
dependency: a lookup that fails (down, slow, refusing, an answer it cannot use) makes the
worker compute everything, and a store that fails only loses the blocks; both are counted in
`cache_errors` and logged. A payload that cannot be decoded is refused like a foreign one.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from cache_service.client import CacheClient, Match
from cache_service.core.errors import InvalidAnswer, ServiceError
from cache_service.integrations.kv_codec import LayerKV, decode_block, encode_block
from cache_service.integrations.kv_layout import BlockRefused
from cache_service.integrations.model import CausalLM

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 64  # the service's default block size
# A store request's payload bytes at most: a long prompt's KV (46 KB a token for SmolLM2 in
# float32: 377 MB at 8k tokens) would pass the service's body limit (512 MiB by default) and
# hold the whole encoding in memory twice.
STORE_REQUEST_BYTES = 64 * 2**20


@dataclass(frozen=True, slots=True)
class Prefill:
    """One prompt's prefill: where its KV came from, what each step took, and the result."""

    prompt_tokens: int
    cached_tokens: int  # tokens whose keys and values were loaded from the cache
    refused_blocks: int  # blocks the cache returned but not used: the first refused and after
    stored_blocks: int  # new full blocks the cache took
    lookup_seconds: float  # the lookup and the payloads' transfer
    load_seconds: float  # decoding payloads into the model's KV cache
    compute_seconds: float  # the model on the tokens not cached
    store_seconds: float  # encoding and storing the new blocks (after the first token)
    logits: torch.Tensor  # the last position's
    cache: DynamicCache  # the prompt's keys and values (and, after generate, the new tokens')

    @property
    def computed_tokens(self) -> int:
        """Tokens the model computed."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def first_token_seconds(self) -> float:
        """Time to the first token: lookup, load and compute (storing can follow it)."""
        return self.lookup_seconds + self.load_seconds + self.compute_seconds


class PrefillWorker:
    """Prefills prompts with `model`, reading and writing KV blocks through `client`."""

    def __init__(
        self,
        model: CausalLM,
        client: CacheClient | None,
        *,
        block_size: int | None = None,
        salt: str | None = None,
        retention: str | None = None,
        store: bool = True,
    ) -> None:
        self.model = model
        self.client = client  # None: no cache, every prompt computed whole
        self.refused: Counter[str] = Counter()  # refused blocks by the field that differed
        self.cache_errors: Counter[str] = Counter()  # failed cache calls by "call status"
        self.layout = model.layout(block_size or self._service_block_size())
        self.salt = salt
        self.retention = retention
        self.store = store

    def _service_block_size(self) -> int:
        """The block size the service cuts this model's prompts into (it refuses others)."""
        if self.client is None:
            return DEFAULT_BLOCK_SIZE
        try:
            return self.client.info().block_size_for(self.model.name)
        except InvalidAnswer as exc:  # not our service's answer
            self.cache_errors["info invalid"] += 1
            logger.warning("prompt cache info not understood: %s", exc.detail)
        except ServiceError as exc:
            self._count_error("info", exc)
        return DEFAULT_BLOCK_SIZE

    def prefill(self, token_ids: Sequence[int]) -> Prefill:
        """Prefill one prompt, loading what the cache holds of it and storing the rest."""
        tokens = list(token_ids)
        if not tokens:
            raise ValueError("a prompt needs at least one token")
        started = time.perf_counter()
        match = self._lookup(tokens)
        looked_up = time.perf_counter()
        blocks, refused = self._decode(match)
        # The last token's logits are needed: with the whole prompt cached, that one is computed.
        cached = min(len(blocks) * self.layout.block_size, len(tokens) - 1)
        cache = self.model.cache_from_blocks(blocks, tokens=cached)
        loaded = time.perf_counter()
        if cached:  # after a prefix, in passes (see model.CHUNK_TOKENS)
            logits, cache = self.model.extend(tokens[cached:], cache)
        else:  # one pass: SDPA's causal kernel skips the masked half
            logits, cache = self.model.forward(tokens, cache)
        computed = time.perf_counter()
        # From the first block the service lacks: refused blocks are held (as first written) and
        # sending them again would only be refused again.
        stored = self._store(tokens, cache, first_block=len(blocks) + refused)
        return Prefill(
            prompt_tokens=len(tokens),
            cached_tokens=cached,
            refused_blocks=refused,
            stored_blocks=stored,
            lookup_seconds=looked_up - started,
            load_seconds=loaded - looked_up,
            compute_seconds=computed - loaded,
            store_seconds=time.perf_counter() - computed,
            logits=logits,
            cache=cache,
        )

    def generate(self, token_ids: Sequence[int], new_tokens: int) -> tuple[Prefill, list[int]]:
        """Prefill a prompt, then decode `new_tokens` greedy tokens after it."""
        prefill = self.prefill(token_ids)
        return prefill, self.model.greedy(prefill.logits, prefill.cache, new_tokens)

    def _lookup(self, tokens: list[int]) -> Match | None:
        if self.client is None or len(tokens) < self.layout.block_size:
            return None
        try:
            return self.client.lookup(
                self.model.name,
                tokens,
                kv_layout=self.layout.namespace_name,
                salt=self.salt,
                retention=self.retention,
                block_size=self.layout.block_size,
                fetch=True,
                copy=False,
            )
        except ServiceError as exc:
            self._count_error("lookup", exc)
            return None

    def _decode(self, match: Match | None) -> tuple[list[list[LayerKV]], int]:
        """The matched blocks up to the first that does not fit the model, and how many the
        cache returned that were refused (that one and every later one: a prefix is whole)."""
        if match is None or not match.payloads:
            return [], 0
        blocks: list[list[LayerKV]] = []
        for payload in match.payloads:
            try:
                blocks.append(decode_block(self.layout, payload))
            except BlockRefused as refusal:
                self._refuse(len(blocks), refusal.field, refusal)
                break
            except Exception as exc:  # whatever a payload does, it never fails a prefill
                self._refuse(len(blocks), "format", exc)
                break
        return blocks, len(match.payloads) - len(blocks)

    def _refuse(self, block: int, field: str, reason: Exception) -> None:
        self.refused[field] += 1
        logger.warning("KV block %d refused (%s): %s", block, field, reason)

    def _store(self, tokens: list[int], cache: DynamicCache, *, first_block: int) -> int:
        """Store full blocks first_block.. of the prompt, in requests of at most
        STORE_REQUEST_BYTES; the count the cache newly took."""
        size = self.layout.block_size
        full_blocks = len(tokens) // size
        if self.client is None or not self.store or first_block >= full_blocks:
            return 0
        per_request = max(1, STORE_REQUEST_BYTES // self.layout.block_kv_bytes)
        stored = 0
        for start in range(first_block, full_blocks, per_request):
            end = min(start + per_request, full_blocks)
            payloads = [
                encode_block(self.layout, self.model.kv_range(cache, i * size, (i + 1) * size))
                for i in range(start, end)
            ]
            try:
                stored += self._send(tokens[: end * size], payloads, start)
            except ServiceError as exc:
                if exc.problem_type.endswith("missing-parent") and start == first_block > 0:
                    # The prefix was evicted since the lookup: store the prompt's blocks whole.
                    return self._store(tokens, cache, first_block=0)
                self._count_error("store", exc)
                break  # later blocks' parents are not stored either
        return stored

    def _send(self, tokens: list[int], payloads: list[bytes], start_block: int) -> int:
        assert self.client is not None
        answer = self.client.store(
            self.model.name,
            tokens,
            payloads,
            kv_layout=self.layout.namespace_name,
            start_block=start_block,
            salt=self.salt,
            retention=self.retention,
            block_size=self.layout.block_size,
        )
        return answer.stored_blocks

    def _count_error(self, call: str, exc: ServiceError) -> None:
        self.cache_errors[f"{call} {exc.status}"] += 1
        logger.warning("prompt cache %s failed (%s); computing without it", call, exc)
