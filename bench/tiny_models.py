"""Small seeded models for the connector's engine tests (tests/vllm) and bench rows.

No model small enough for these tests ships with an MLA attention, or with heads that split
over two tensor-parallel ranks (SmolLM2-135M has 9), so the tests make their own: random
weights from a fixed seed, a vocabulary of 1,024 ids (prompts are token ids; the engines run
without a tokenizer), a few MB each, written in about a second and kept beside SmolLM2.

- `deepseek_v2_mla`: DeepSeek-V2's MLA attention (latent KV of `kv_lora_rank` 512 plus the
  64-wide rope part: 576, the only head size vLLM's CPU_MLA backend takes), two layers, the
  second a mixture of experts, as the real model's.
- `llama_gqa`: a Llama with 4 query heads over 2 KV heads, which splits over 2 ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 1024
SEED = 1234
# Wider than transformers' 0.02: with it, greedy output settles on one token after a few,
# and a test could not tell the right KV from wrong KV by the tokens.
INIT_RANGE = 0.15


def deepseek_v2_mla(folder: Path) -> Path:
    """A tiny DeepSeek-V2 (MLA) model folder, made once."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM  # noqa: PLC0415

    config = DeepseekV2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        max_position_embeddings=4096,
        initializer_range=INIT_RANGE,
    )
    return _write(folder, DeepseekV2ForCausalLM, config)


def llama_gqa(folder: Path) -> Path:
    """A tiny Llama whose 2 KV heads split over 2 tensor-parallel ranks, made once."""
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=INIT_RANGE,
    )
    return _write(folder, LlamaForCausalLM, config)


def _write(folder: Path, model_class: type, config: object) -> Path:
    done = folder / "config.json"
    if done.exists():
        return folder
    import torch  # noqa: PLC0415

    torch.manual_seed(SEED)
    partial = folder.with_name(folder.name + ".partial")
    model = model_class(config)
    model.save_pretrained(partial)
    # vLLM reads the generation defaults; greedy tests set their own sampling.
    (partial / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    partial.rename(folder)
    return folder
