"""vLLM's KV connector for the prompt cache service: `PromptCacheConnector`.

Point vLLM at it without patching vLLM:

    --kv-transfer-config '{"kv_connector": "PromptCacheConnector",
        "kv_connector_module_path": "cache_service.integrations.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"url": "http://127.0.0.1:8080"}}'

vLLM imports this package in its API server process too, so importing it does nothing: vLLM
itself is imported only when the class is first asked for (`connector.py`). The parts that
need no vLLM (`groups`, `layout`, `options`, `plan`, `scheduler_side`, `counters`) are tested
without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PromptCacheConnector"]


def __getattr__(name: str) -> Any:
    if name == "PromptCacheConnector":
        from cache_service.integrations.vllm.connector import (  # noqa: PLC0415 (lazy: vLLM)
            PromptCacheConnector,
        )

        return PromptCacheConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
