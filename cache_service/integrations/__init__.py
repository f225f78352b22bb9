"""Integrations: the prompt cache seen from a model runtime (imported only when used).

`kv_layout` says what a KV block must match to be loaded (model, weights digest, layers, KV
heads, head size, dtype, block size) and reads and writes each block's header; `kv_codec`
turns one block of a model's per-layer keys and values into a payload and back; `model`
wraps a Hugging Face causal LM (a GGUF checkpoint, or a tiny seeded one for tests) behind the
few calls a prefill worker needs; `worker` is the reference prefill worker: look up the longest
cached prefix with its payloads, rebuild the KV cache, compute only the rest, store the new
blocks; `demo` drives it through a chat and an agent loop (`cache-service demo`).

Only `kv_layout` is plain Python; the rest needs the `[model]` extra (PyTorch, transformers).
"""
