"""A test-only PromptCacheConnector that, when a request asks, changes the store between the
lookup and the load: the real connector in every other respect, loaded by vLLM the way users
load ours (`kv_connector_module_path`).

A request's `kv_transfer_params` may say `{"tamper": "purge"}`: the request's namespace is
purged right after the lookup found blocks (the load then finds none), or
`{"tamper": "corrupt"}`: purged, then the same prompt stored again with pieces whose headers
are right and whose KV bytes are not (the load then takes wrong KV, and the output changes),
or `{"tamper": "purge_rank1"}`: only tensor-parallel rank 1's namespace is purged (rank 1's
load then fails while rank 0's succeeds).
"""

from __future__ import annotations

from typing import Any

import httpx

from cache_service.client import CacheClient
from cache_service.integrations.vllm.connector import PromptCacheConnector, prompt_request


class TamperingConnector(PromptCacheConnector):  # type: ignore[misc]
    """PromptCacheConnector with a purge or a corruption between lookup and load on request."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        """The real answer; then, if the request asks, the store changed under it."""
        answer = super().get_num_new_matched_tokens(request, num_computed_tokens)
        tamper = (request.kv_transfer_params or {}).get("tamper")
        if tamper and answer[0] and self._scheduler is not None:
            self._tamper(request, tamper)
        return answer

    def _tamper(self, request: Any, tamper: str) -> None:
        scheduler = self._scheduler
        assert scheduler is not None and scheduler.groups is not None
        groups = scheduler.groups
        prompt = prompt_request(request)
        layout = self.layout.for_rank(1) if tamper == "purge_rank1" else self.layout
        namespace = {
            "model": layout.model,
            "kv_layout": layout.namespace_name,
            "salt": prompt.cache_salt,
        }
        httpx.post(self.options.url + "/v1/purge", json=namespace, timeout=10).raise_for_status()
        if tamper != "corrupt":
            return
        whole = groups.whole_groups(len(prompt.prompt_tokens))
        piece_bytes = groups.piece_bytes(layout.block_bytes)
        wrong = bytes([0x3F]) * piece_bytes  # bf16 0x3F3F: about 0.75 everywhere
        payloads = [
            layout.header(
                piece=index % groups.service_blocks,
                pieces=groups.service_blocks,
                kv_layout=layout.namespace_name,
            )
            + wrong
            for index in range(whole * groups.service_blocks)
        ]
        with CacheClient(self.options.url, timeout=60) as client:
            client.store(
                layout.model,
                prompt.prompt_tokens[: whole * groups.group_tokens],
                payloads,
                kv_layout=layout.namespace_name,
                salt=prompt.cache_salt,
                block_size=groups.service_block_tokens,
            )
