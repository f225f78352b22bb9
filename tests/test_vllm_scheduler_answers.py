"""The scheduler half's answers that a test service cannot easily give: a lookup still under
way ("ask again later"), and answers of another shape (error paths, over httpx.MockTransport).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson

from cache_service.client import CacheClient
from cache_service.integrations.vllm.counters import Counters
from cache_service.integrations.vllm.options import ConnectorOptions
from cache_service.integrations.vllm.requests import PromptRequest
from cache_service.integrations.vllm.scheduler_side import SchedulerSide
from tests.vllm_layout import TEST_LAYOUT
from tests.wire_samples import info_body

LAYOUT = TEST_LAYOUT
KEY = "0" * 32


def _side(
    answer: Callable[[httpx.Request], httpx.Response], counters: Counters, **options: Any
) -> SchedulerSide:
    client = CacheClient("http://cache.test", transport=httpx.MockTransport(answer), fail_open=True)
    return SchedulerSide(
        options=ConnectorOptions(url="http://cache.test", **options),
        layout=LAYOUT,
        client=client,
        counters=counters,
        role_load=True,
        role_store=True,
    )


def _service(
    *, block_size: Any = 64, matched: int = 4, keys: int = 4, delay: float = 0.0
) -> Callable[[httpx.Request], httpx.Response]:
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/info":
            body = info_body()
            body["block_size"]["default"] = block_size  # of any type: answers of other shapes
            return httpx.Response(200, json=body)
        time.sleep(delay)
        body = {
            "model": "m",
            "block_size": 64,
            "prompt_tokens": 600,
            "matched_blocks": matched,
            "cached_tokens": matched * 64,
            "keys": [KEY] * keys,
            "retention": "chat",
            "usage": {"prompt_cache_hit_tokens": matched * 64, "prompt_cache_miss_tokens": 0},
        }
        return httpx.Response(
            200, content=orjson.dumps(body), headers={"Content-Type": "application/json"}
        )

    return answer


def _request(name: str = "r") -> PromptRequest:
    return PromptRequest(request_id=name, prompt_tokens=list(range(600)))


def test_a_lookup_slower_than_the_wait_is_asked_for_again_later() -> None:
    counters = Counters()
    side = _side(_service(delay=0.3), counters, lookup_wait_seconds=0.01)
    assert side.matched_tokens(_request(), 0) is None  # vLLM schedules others meanwhile
    answers = [side.matched_tokens(_request(), 0)]
    deadline = time.monotonic() + 10
    while answers[-1] is None and time.monotonic() < deadline:
        time.sleep(0.02)
        answers.append(side.matched_tokens(_request(), 0))
    assert answers[-1] == 4 * 64 // 128 * 128  # 4 service blocks: 2 groups of 128
    assert counters.totals()["lookups"] == 1  # one lookup however often vLLM asks


def test_an_answer_with_fewer_keys_than_blocks_holds_only_what_its_keys_cover() -> None:
    side = _side(_service(matched=4, keys=3), Counters(), lookup_wait_seconds=10.0)
    assert side.matched_tokens(_request(), 0) == 128  # 3 keys: one whole group of two


def test_a_block_size_below_one_is_no_block_size_not_an_error() -> None:
    counters = Counters()
    side = _side(_service(block_size=0), counters, lookup_wait_seconds=10.0)
    assert side.matched_tokens(_request(), 0) == 0
    assert counters.totals()["miss_no_block_size"] >= 1


def test_an_info_of_another_shape_is_no_block_size_not_an_error() -> None:
    counters = Counters()
    side = _side(_service(block_size={"x": 1}), counters, lookup_wait_seconds=10.0)
    assert side.matched_tokens(_request(), 0) == 0
    assert counters.totals()["miss_no_block_size"] >= 1


def test_kv_transfer_params_that_are_not_an_object_are_the_defaults() -> None:
    counters = Counters()
    side = _side(_service(), counters, lookup_wait_seconds=10.0)
    odd = PromptRequest(request_id="odd", prompt_tokens=list(range(600)), kv_transfer_params=7)  # type: ignore[arg-type]
    assert side.matched_tokens(odd, 0) == 256
    assert counters.totals()["miss_bad_request_options"] == 1


def test_after_stop_nothing_is_loaded_or_stored() -> None:
    side = _side(_service(), Counters(), lookup_wait_seconds=10.0)
    side.stop("a test")
    assert side.matched_tokens(_request(), 0) == 0
