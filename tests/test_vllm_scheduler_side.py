"""The vLLM connector's scheduler half (no vLLM) against a real `cache-service serve`.

One service (default flags, block size 64) serves the whole module; every test uses prompts
of its own (seeded by the test's id), so no test sees another's blocks. The engine pages KV in
blocks of 128 tokens, so a group is 128 tokens: one vLLM block, two service blocks. The
scheduler never reads payloads, so blocks are stored through the client with any bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cache_service.client import CacheClient
from cache_service.integrations.vllm.counters import Counters
from cache_service.integrations.vllm.handoff import Tail, report, tail_of
from cache_service.integrations.vllm.layout import EngineLayout
from cache_service.integrations.vllm.options import ConnectorOptions, OptionError, RequestOptions
from cache_service.integrations.vllm.plan import LoadTask, Namespace, StoreTask
from cache_service.integrations.vllm.requests import PromptRequest, ScheduledRequest
from cache_service.integrations.vllm.scheduler_side import SchedulerSide
from tests.integration.conftest import ServerProcess, free_port
from tests.vllm_layout import TEST_LAYOUT

pytestmark = pytest.mark.integration

SERVICE_BLOCK = 64  # the service's default block size
GROUP = 128  # lcm(128, 64)
LAYOUT = TEST_LAYOUT
PROMPT = 600  # tokens: 4 whole groups and 88 tokens more
# The scheduler waits for a lookup this long before "ask again later": here, always its answer
SYNCHRONOUS = {"lookup_wait_seconds": 30.0}
Prompts = Callable[[int], list[int]]
MakeSide = Callable[..., SchedulerSide]


@pytest.fixture(scope="module")
def cache_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A real `cache-service serve` on 127.0.0.1 (default block size 64), stopped after."""
    folder = tmp_path_factory.mktemp("vllm-scheduler")
    server = ServerProcess(folder / "data", folder / "server.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(cache_server: ServerProcess) -> Iterator[CacheClient]:
    """A fail-open client of the module's service, as the connector makes one."""
    with CacheClient(cache_server.url, fail_open=True, timeout=2.0) as made:
        yield made


@pytest.fixture
def counters() -> Counters:
    """The connector's counts, fresh for each test."""
    return Counters()


@pytest.fixture
def make_side(cache_server: ServerProcess, client: CacheClient, counters: Counters) -> MakeSide:
    """A SchedulerSide on the module's service; keywords change its layout, roles or options."""

    def make(
        *,
        layout: EngineLayout = LAYOUT,
        role_load: bool = True,
        role_store: bool = True,
        **options: Any,
    ) -> SchedulerSide:
        return SchedulerSide(
            options=ConnectorOptions(url=cache_server.url, **{**SYNCHRONOUS, **options}),
            layout=layout,
            client=client,
            counters=counters,
            role_load=role_load,
            role_store=role_store,
        )

    return make


@contextlib.contextmanager
def side_on_own_service(
    tmp_path: Path, counters: Counters, **flags: str
) -> Iterator[tuple[SchedulerSide, CacheClient, ServerProcess]]:
    """A SchedulerSide, its client and a service of its own started with `flags` (stopped
    after, if the test has not)."""
    server = ServerProcess(tmp_path / "data", tmp_path / "server.log", **flags)
    server.start()
    try:
        with CacheClient(server.url, fail_open=True, timeout=2.0) as own:
            yield (
                SchedulerSide(
                    options=ConnectorOptions(url=server.url, **SYNCHRONOUS),
                    layout=LAYOUT,
                    client=own,
                    counters=counters,
                    role_load=True,
                    role_store=True,
                ),
                own,
                server,
            )
    finally:
        server.stop()


@pytest.fixture
def prompts(request: pytest.FixtureRequest) -> Prompts:
    """Prompts of random token ids no other test uses (seeded by the test's id)."""
    rng = random.Random(request.node.nodeid)
    return lambda length: [rng.randrange(50_000) for _ in range(length)]


def store(
    client: CacheClient,
    tokens: list[int],
    service_blocks: int,
    *,
    layout: EngineLayout = LAYOUT,
    salt: str = "",
) -> list[str]:
    """Store the first `service_blocks` service blocks of `tokens` (any bytes); their keys."""
    result = client.store(
        layout.model,
        tokens[: service_blocks * SERVICE_BLOCK],
        [b"kv of block %d" % i for i in range(service_blocks)],
        kv_layout=layout.namespace_name,
        start_block=0,
        block_size=SERVICE_BLOCK,
        salt=salt,
    )
    assert result.stored_blocks == service_blocks
    return result.keys


def namespace(salt: str = "", retention: str = "", layout: EngineLayout = LAYOUT) -> Namespace:
    """The namespace a request's blocks live in."""
    return Namespace(
        model="m",
        kv_layout=layout.namespace_name,
        salt=salt,
        retention=retention,
        lora=layout.lora,
    )


def prefill(request_id: str, block_ids: list[int], tokens: int) -> ScheduledRequest:
    """A new request's first step: all its blocks, and `tokens` computed from the start."""
    return ScheduledRequest(request_id, block_ids, True, 0, tokens)


# -- lookups ------------------------------------------------------------------------------------


def test_a_prompt_the_service_never_saw_matches_nothing(
    make_side: MakeSide, counters: Counters, prompts: Prompts
) -> None:
    side = make_side()
    assert side.matched_tokens(PromptRequest("r", prompts(PROMPT)), 0) == 0
    assert counters.totals() == {"lookups": 1, "lookup_tokens": PROMPT}


def test_the_whole_groups_the_service_holds_match_beyond_vllms_own_tokens(
    make_side: MakeSide, client: CacheClient, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    store(client, tokens, 6)  # 3 groups
    side = make_side()
    assert side.matched_tokens(PromptRequest("r0", tokens), 0) == 3 * GROUP
    assert side.matched_tokens(PromptRequest("r1", tokens), GROUP) == 2 * GROUP
    assert side.matched_tokens(PromptRequest("r3", tokens), 3 * GROUP) == 0
    assert side.matched_tokens(PromptRequest("r4", tokens), 4 * GROUP) == 0


def test_a_group_the_service_holds_in_part_does_not_match(
    make_side: MakeSide, client: CacheClient, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    store(client, tokens, 5)  # 2 groups and half of the third
    assert make_side().matched_tokens(PromptRequest("r", tokens), 0) == 2 * GROUP


def test_a_synchronous_load_never_matches_the_last_prompt_token(
    make_side: MakeSide, client: CacheClient, prompts: Prompts
) -> None:
    tokens = prompts(3 * GROUP)  # exactly 3 groups, all stored
    store(client, tokens, 6)
    sync = make_side(load_mode="sync")
    assert sync.matched_tokens(PromptRequest("r", tokens), 0) == 2 * GROUP
    assert make_side(load_mode="sync").matched_tokens(PromptRequest("r", [*tokens, 7]), 0) == (
        3 * GROUP
    )


def test_an_asynchronous_load_matches_the_prompt_to_its_last_token(
    make_side: MakeSide, client: CacheClient, prompts: Prompts
) -> None:
    tokens = prompts(3 * GROUP)  # exactly 3 groups, all stored
    store(client, tokens, 6)
    side = make_side(load_mode="async")
    assert side.matched_tokens(PromptRequest("r", tokens), 0) == 3 * GROUP


def test_a_request_whose_load_failed_is_offered_nothing_more(
    make_side: MakeSide, client: CacheClient, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    store(client, tokens, 8)
    side = make_side()
    assert side.matched_tokens(PromptRequest("r", tokens), 0) == 4 * GROUP
    side.allocated("r", [1, 2, 3, 4, 5], 4 * GROUP)
    side.load_failed({3, 99})  # vLLM's invalid blocks: one of r's, one of another request's
    # vLLM asks again after a failed asynchronous load: the same offer would fail forever
    assert side.matched_tokens(PromptRequest("r", tokens), 0) == 0
    other = prompts(PROMPT)
    store(client, other, 8)
    assert side.matched_tokens(PromptRequest("o", other), 0) == 4 * GROUP  # others unaffected


def test_a_failed_asynchronous_load_stores_the_groups_vllm_computes_again(
    make_side: MakeSide, client: CacheClient, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    store(client, tokens, 8)  # 4 whole groups
    side = make_side(load_mode="async")
    assert side.matched_tokens(PromptRequest("r", tokens), 0) == 4 * GROUP
    side.allocated("r", [1, 2, 3, 4, 5], 4 * GROUP)
    assert len(side.plan_step([]).loads) == 1  # the load, while vLLM holds the request back
    # Group 1 failed to load: vLLM computes from its start, and those groups are stored again
    resumed = ScheduledRequest("r", [1, 2, 3, 4, 5], True, GROUP, PROMPT - GROUP)
    (task,) = side.plan_step([resumed]).stores
    assert task.first_group == 1 and task.block_ids == [2, 3, 4]


def test_asking_twice_for_a_request_looks_it_up_once(
    make_side: MakeSide, client: CacheClient, counters: Counters, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    store(client, tokens, 4)
    side = make_side()
    request = PromptRequest("r", tokens)
    assert side.matched_tokens(request, 0) == 2 * GROUP
    assert side.matched_tokens(request, 0) == 2 * GROUP
    assert side.matched_tokens(request, GROUP) == GROUP  # vLLM's own cache grew meanwhile
    assert counters.totals()["lookups"] == 1
    side.finished("r")
    assert side.matched_tokens(request, 0) == 2 * GROUP
    assert counters.totals()["lookups"] == 2


def test_a_prompt_shorter_than_a_group_is_not_looked_up(
    make_side: MakeSide, counters: Counters, prompts: Prompts
) -> None:
    side = make_side()
    assert side.matched_tokens(PromptRequest("r", prompts(GROUP - 1)), 0) == 0
    assert side.plan_step([prefill("r", [1], GROUP - 1)]).stores == []
    assert "lookups" not in counters.totals()


# -- loads --------------------------------------------------------------------------------------


def test_allocated_blocks_load_the_lookups_keys_of_the_matched_groups(
    make_side: MakeSide, client: CacheClient, counters: Counters, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    keys = store(client, tokens, 6)  # 3 groups
    side = make_side()
    assert side.matched_tokens(PromptRequest("r", tokens), GROUP) == 2 * GROUP
    side.allocated("r", [7, 8, 9, 10, 11], 2 * GROUP)
    plan = side.plan_step([])
    assert plan.service_block_tokens == SERVICE_BLOCK
    assert plan.loads == [
        LoadTask(
            request_id="r",
            namespace=namespace(),
            first_group=1,
            keys=keys[2:6],
            block_ids=[8, 9],
            skip=0,
        )
    ]
    assert plan.stores == []
    assert side.plan_step([]).loads == []  # a load is planned once
    assert counters.totals()["hit_tokens"] == 2 * GROUP


def test_nothing_loads_when_vllm_takes_no_external_tokens(
    make_side: MakeSide, client: CacheClient, counters: Counters, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    store(client, tokens, 4)
    side = make_side()
    side.matched_tokens(PromptRequest("r", tokens), 0)
    side.allocated("r", [1, 2, 3], 0)
    assert side.plan_step([]).loads == []
    assert "hit_tokens" not in counters.totals()


def test_a_load_skips_the_blocks_of_its_first_group_vllm_holds(
    make_side: MakeSide, client: CacheClient, prompts: Prompts
) -> None:
    # vLLM blocks of 32 tokens: a group is 64 tokens, two vLLM blocks and one service block.
    small = dataclasses.replace(LAYOUT, engine_block_tokens=32, block_bytes=LAYOUT.block_bytes // 4)
    tokens = prompts(300)
    keys = store(client, tokens, 4, layout=small)
    side = make_side(layout=small)
    assert side.matched_tokens(PromptRequest("r1", tokens), 32) == 256 - 32
    side.allocated("r1", list(range(100, 110)), 256 - 32)
    assert side.matched_tokens(PromptRequest("r3", tokens), 96) == 256 - 96
    side.allocated("r3", list(range(200, 210)), 256 - 96)
    first, second = side.plan_step([]).loads
    assert (first.first_group, first.keys, first.skip) == (0, keys, 1)
    assert first.block_ids == list(range(101, 108))
    assert (second.first_group, second.keys, second.skip) == (1, keys[1:], 1)
    assert second.block_ids == list(range(203, 208))
    assert first.namespace.kv_layout == small.namespace_name


# -- stores -------------------------------------------------------------------------------------


def test_a_chunked_prefill_stores_each_group_once_it_is_whole_from_the_first_one_lacking(
    make_side: MakeSide, client: CacheClient, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    store(client, tokens, 4)  # the service holds groups 0 and 1
    side = make_side()
    assert side.matched_tokens(PromptRequest("r", tokens), 0) == 2 * GROUP
    side.allocated("r", [10, 11, 12], 2 * GROUP)
    # Step 1: the two loaded groups and 44 tokens of group 2.
    plan = side.plan_step([ScheduledRequest("r", [10, 11, 12], True, 2 * GROUP, 44)])
    assert [load.block_ids for load in plan.loads] == [[10, 11]]
    assert plan.stores == []
    # Step 2: group 2 becomes whole (up to token 400).
    plan = side.plan_step([ScheduledRequest("r", [13], False, 300, 100)])
    assert plan.stores == [
        StoreTask(
            request_id="r",
            namespace=namespace(),
            first_group=2,
            tokens=tokens[: 3 * GROUP],
            block_ids=[12],
        )
    ]
    # Step 3: the prompt's end: group 3 whole, the last 88 tokens never stored.
    plan = side.plan_step([ScheduledRequest("r", [14], False, 400, PROMPT - 400)])
    assert plan.stores == [
        StoreTask(
            request_id="r",
            namespace=namespace(),
            first_group=3,
            tokens=tokens[: 4 * GROUP],
            block_ids=[13],
        )
    ]
    # Decoding: generated tokens are never stored.
    for computed in range(PROMPT, PROMPT + 2 * GROUP, 8):
        assert side.plan_step([ScheduledRequest("r", [99], False, computed, 8)]).stores == []


def test_a_chunk_that_completes_several_groups_stores_them_in_one_task(
    make_side: MakeSide, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    side = make_side()
    assert side.matched_tokens(PromptRequest("r", tokens), 0) == 0
    assert side.plan_step([prefill("r", [5], 100)]).stores == []
    (task,) = side.plan_step([ScheduledRequest("r", [6, 7, 8], False, 100, 450)]).stores
    assert (task.first_group, task.tokens, task.block_ids) == (0, tokens[: 4 * GROUP], [5, 6, 7, 8])


def test_a_recompute_plans_the_stores_again_from_where_vllm_went_back_to(
    make_side: MakeSide, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    side = make_side()
    side.matched_tokens(PromptRequest("r", tokens), 0)
    (task,) = side.plan_step([prefill("r", [1, 2, 3, 4, 5], PROMPT)]).stores
    assert task.first_group == 0 and task.block_ids == [1, 2, 3, 4]
    # Preempted and resumed in new blocks, computing from the start again.
    (task,) = side.plan_step([prefill("r", [20, 21, 22], 300)]).stores
    assert (task.first_group, task.tokens, task.block_ids) == (0, tokens[: 2 * GROUP], [20, 21])
    (task,) = side.plan_step([ScheduledRequest("r", [23, 24], False, 300, 300)]).stores
    assert (task.first_group, task.tokens, task.block_ids) == (2, tokens[: 4 * GROUP], [22, 23])
    # Back to a point mid-prompt: only the groups from there on are planned again.
    (task,) = side.plan_step([ScheduledRequest("r", [30, 31, 32, 33, 34], True, 300, 300)]).stores
    assert (task.first_group, task.block_ids) == (2, [32, 33])


def test_a_request_not_looked_up_or_finished_is_not_planned(
    make_side: MakeSide, prompts: Prompts
) -> None:
    side = make_side()
    assert side.plan_step([prefill("never-asked", [1, 2, 3, 4, 5], PROMPT)]).stores == []
    side.matched_tokens(PromptRequest("r", prompts(PROMPT)), 0)
    side.finished("r")
    assert side.plan_step([prefill("r", [1, 2, 3, 4, 5], PROMPT)]).stores == []


# -- roles and a request's own options ---------------------------------------------------------


def test_without_the_load_role_nothing_matches_but_stores_start_past_what_the_service_holds(
    make_side: MakeSide, client: CacheClient, counters: Counters, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    store(client, tokens, 4)
    side = make_side(role_load=False)
    assert side.matched_tokens(PromptRequest("r", tokens), 0) == 0
    assert counters.totals()["lookups"] == 1
    (task,) = side.plan_step([prefill("r", [1, 2, 3, 4, 5], PROMPT)]).stores
    assert (task.first_group, task.block_ids) == (2, [3, 4])


def test_without_the_store_role_nothing_is_ever_stored(
    make_side: MakeSide, client: CacheClient, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    store(client, tokens, 4)
    side = make_side(role_store=False)
    assert side.matched_tokens(PromptRequest("r", tokens), 0) == 2 * GROUP
    side.allocated("r", [1, 2, 3], 2 * GROUP)
    plan = side.plan_step([ScheduledRequest("r", [1, 2, 3, 4, 5], True, 2 * GROUP, 344)])
    assert len(plan.loads) == 1 and plan.stores == []
    assert side.plan_step([prefill("r", [6, 7, 8, 9, 10], PROMPT)]).stores == []


@pytest.mark.parametrize(
    ("own", "expected"),
    [
        ({"load": False}, (0, [2])),  # stores start past the groups the service holds
        ({"store": False}, (2 * GROUP, [])),
        ({"load": False, "store": False}, (0, [])),
    ],
)
def test_a_request_may_skip_loading_or_storing(
    make_side: MakeSide,
    client: CacheClient,
    prompts: Prompts,
    own: dict[str, bool],
    expected: tuple[int, list[int]],
) -> None:
    tokens = prompts(PROMPT)
    store(client, tokens, 4)
    side = make_side()
    request = PromptRequest("r", tokens, kv_transfer_params={"prompt_cache": own})
    matched = side.matched_tokens(request, 0)
    stores = side.plan_step([prefill("r", [1, 2, 3, 4, 5], PROMPT)]).stores
    assert (matched, [task.first_group for task in stores]) == expected


@pytest.mark.parametrize("kind", ["multimodal", "prompt_embeds"])
def test_a_request_whose_token_ids_do_not_say_its_kv_is_passed_over(
    make_side: MakeSide, client: CacheClient, counters: Counters, prompts: Prompts, kind: str
) -> None:
    tokens = prompts(PROMPT)
    store(client, tokens, 4)
    side = make_side()
    request = PromptRequest(
        "r", tokens, multimodal=kind == "multimodal", prompt_embeds=kind == "prompt_embeds"
    )
    assert side.matched_tokens(request, 0) == 0
    assert side.matched_tokens(request, 0) == 0
    plan = side.plan_step([prefill("r", [1, 2, 3, 4, 5], PROMPT)])
    assert plan.loads == [] and plan.stores == []
    assert counters.totals() == {f"miss_{kind}": 1}


def test_a_salt_gives_another_namespace(
    make_side: MakeSide, client: CacheClient, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    store(client, tokens, 4, salt="a")
    side = make_side()
    assert side.matched_tokens(PromptRequest("a", tokens, cache_salt="a"), 0) == 2 * GROUP
    assert side.matched_tokens(PromptRequest("b", tokens, cache_salt="b"), 0) == 0
    assert side.matched_tokens(PromptRequest("none", tokens), 0) == 0
    side.allocated("a", [1, 2, 3], 2 * GROUP)
    (load,) = side.plan_step([]).loads
    assert load.namespace == namespace(salt="a")
    (task,) = side.plan_step([prefill("b", [1, 2, 3, 4, 5], PROMPT)]).stores
    assert task.namespace == namespace(salt="b") and task.first_group == 0


def test_with_tensor_parallelism_only_groups_every_rank_holds_are_offered(
    make_side: MakeSide, client: CacheClient, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    sharded = dataclasses.replace(LAYOUT, tp_size=2)
    rank0 = store(client, tokens, 8, layout=sharded)  # every whole group of rank 0's shard
    rank1 = store(client, tokens, 4, layout=sharded.for_rank(1))  # two groups of rank 1's
    side = make_side(layout=sharded)
    assert side.matched_tokens(PromptRequest("r", tokens), 0) == 2 * GROUP
    side.allocated("r", [10, 11, 12, 13, 14], 2 * GROUP)
    (load,) = side.plan_step([prefill("r", [10, 11, 12, 13, 14], 2 * GROUP)]).loads
    assert load.keys_of(0) == rank0[:4] and load.keys_of(1) == rank1[:4]
    # The same prompt with rank 1's shard gone altogether: nothing is offered (no loop)
    other = prompts(PROMPT)
    store(client, other, 8, layout=sharded)
    assert make_side(layout=sharded).matched_tokens(PromptRequest("o", other), 0) == 0


def test_replicated_kv_is_looked_up_once_under_a_rank_free_namespace(
    make_side: MakeSide, client: CacheClient, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    replicated = dataclasses.replace(LAYOUT, tp_size=2, tp_replicated=True)
    keys = store(client, tokens, 4, layout=replicated)
    side = make_side(layout=replicated)
    assert side.matched_tokens(PromptRequest("r", tokens), 0) == 2 * GROUP
    side.allocated("r", [3, 4], 2 * GROUP)
    (load,) = side.plan_step([prefill("r", [3, 4], 2 * GROUP)]).loads
    assert load.keys_of(0) == load.keys_of(1) == keys


def test_a_lora_adapter_gives_another_namespace(
    make_side: MakeSide, client: CacheClient, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    adapter = "sql /adapters/sql"
    store(client, tokens, 4)  # the base model's KV
    store(client, tokens, 2, layout=LAYOUT.for_lora(adapter))  # the adapter's: one group
    side = make_side()
    assert side.matched_tokens(PromptRequest("base", tokens), 0) == 2 * GROUP
    assert side.matched_tokens(PromptRequest("sql", tokens, lora=adapter), 0) == GROUP
    assert side.matched_tokens(PromptRequest("chat", tokens, lora="chat /adapters/chat"), 0) == 0
    (task,) = side.plan_step([prefill("sql", [1, 2, 3, 4, 5], PROMPT)]).stores
    assert task.namespace == namespace(layout=LAYOUT.for_lora(adapter))
    assert task.first_group == 1


def test_bad_request_options_are_counted_and_the_defaults_used(
    make_side: MakeSide, client: CacheClient, counters: Counters, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    store(client, tokens, 4)
    side = make_side(retention="chat")
    params = {"prompt_cache": {"load": "yes", "retention": "agent"}}
    request = PromptRequest("r", tokens, kv_transfer_params=params)
    assert side.matched_tokens(request, 0) == 2 * GROUP
    assert counters.totals()["miss_bad_request_options"] == 1
    (task,) = side.plan_step([prefill("r", [1, 2, 3, 4, 5], PROMPT)]).stores
    assert task.namespace.retention == "chat"  # the connector's, not the refused request's


def test_a_requests_retention_goes_with_its_loads_and_stores(
    make_side: MakeSide, client: CacheClient, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    store(client, tokens, 4)
    side = make_side(retention="chat")
    params = {"prompt_cache": {"retention": "agent"}}
    assert side.matched_tokens(PromptRequest("r", tokens, kv_transfer_params=params), 0) == 256
    side.allocated("r", [1, 2, 3], 2 * GROUP)
    plan = side.plan_step([ScheduledRequest("r", [1, 2, 3, 4, 5], True, 2 * GROUP, 344)])
    assert [load.namespace for load in plan.loads] == [namespace(retention="agent")]
    assert [task.namespace for task in plan.stores] == [namespace(retention="agent")]
    # Without its own, a request gets the connector's.
    side.matched_tokens(PromptRequest("plain", tokens), 0)
    (task,) = side.plan_step([prefill("plain", [1, 2, 3, 4, 5], PROMPT)]).stores
    assert task.namespace.retention == "chat"


def test_a_retention_the_service_does_not_know_is_a_miss_not_an_error(
    make_side: MakeSide, client: CacheClient, counters: Counters, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    store(client, tokens, 4)
    side = make_side()
    params = {"prompt_cache": {"retention": "no-such-class"}}
    assert side.matched_tokens(PromptRequest("r", tokens, kv_transfer_params=params), 0) == 0
    assert counters.totals()["miss_lookup_failed"] == 1


# -- a service that is down ---------------------------------------------------------------------


def test_a_service_that_is_down_from_the_start_gives_misses_not_errors(
    prompts: Prompts, counters: Counters
) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    with CacheClient(url, fail_open=True, timeout=2.0) as down:
        side = SchedulerSide(
            options=ConnectorOptions(url=url, **SYNCHRONOUS),
            layout=LAYOUT,
            client=down,
            counters=counters,
            role_load=True,
            role_store=True,
        )
        assert side.matched_tokens(PromptRequest("r", prompts(PROMPT)), 0) == 0
        assert side.matched_tokens(PromptRequest("r2", prompts(PROMPT)), 0) == 0
        plan = side.plan_step([prefill("r", [1, 2, 3, 4, 5], PROMPT)])
    assert plan.service_block_tokens == 0
    assert plan.loads == [] and plan.stores == []
    # The block size is asked for at most every few seconds, each failure counted.
    assert counters.totals() == {"miss_no_block_size": 1}


def test_a_service_that_goes_down_gives_misses_not_errors(
    tmp_path: Path, prompts: Prompts, counters: Counters
) -> None:
    with side_on_own_service(tmp_path, counters) as (side, own, server):
        tokens = prompts(PROMPT)
        store(own, tokens, 4)
        assert side.matched_tokens(PromptRequest("up", tokens), 0) == 2 * GROUP
        server.stop()
        assert side.matched_tokens(PromptRequest("down", tokens), 0) == 0
        assert side.matched_tokens(PromptRequest("backing-off", tokens), 0) == 0
        assert counters.totals()["miss_lookup_failed"] == 2
        # What vLLM computes itself is still planned for storing (the worker fails open).
        (task,) = side.plan_step([prefill("down", [1, 2, 3, 4, 5], PROMPT)]).stores
        assert task.first_group == 0


# -- block sizes --------------------------------------------------------------------------------


def test_block_sizes_making_large_groups_are_warned_about(
    make_side: MakeSide, caplog: pytest.LogCaptureFixture
) -> None:
    odd = dataclasses.replace(LAYOUT, engine_block_tokens=100, block_bytes=100 * 32)
    with caplog.at_level(logging.WARNING, logger="vllm.prompt_cache_connector"):
        groups = make_side(layout=odd).groups
    assert groups is not None and groups.group_tokens == 1600
    assert "--model-block-size 'm=100'" in caplog.text


def test_block_sizes_making_small_groups_are_not_warned_about(
    make_side: MakeSide, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="vllm.prompt_cache_connector"):
        groups = make_side().groups
    assert groups is not None and groups.group_tokens == GROUP
    assert caplog.text == ""


def test_the_services_own_block_size_for_the_model_is_used(
    tmp_path: Path, prompts: Prompts, counters: Counters
) -> None:
    with side_on_own_service(tmp_path, counters, model_block_size="m=128") as (side, own, _):
        groups = side.groups
        assert groups is not None
        assert (groups.service_block_tokens, groups.service_blocks) == (128, 1)
        tokens = prompts(PROMPT)
        result = own.store("m", tokens[:384], [b"a", b"b", b"c"], kv_layout=LAYOUT.namespace_name)
        assert (result.block_size, result.stored_blocks) == (128, 3)
        assert side.matched_tokens(PromptRequest("r", tokens), 0) == 3 * 128
        side.allocated("r", [4, 5, 6, 7], 3 * 128)
        plan = side.plan_step([])
        assert plan.service_block_tokens == 128
        assert [(load.keys, load.block_ids) for load in plan.loads] == [(result.keys, [4, 5, 6])]


# -- prefill and decode engines: the hand-off ----------------------------------------------

PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}  # what vLLM's proxies send P


def store_more(client: CacheClient, tokens: list[int], first: int, end: int) -> None:
    """Store service blocks first..end-1 of `tokens` (their parents are held)."""
    client.store(
        "m",
        tokens[: end * 64],
        [b"kv of block %d" % i for i in range(first, end)],
        kv_layout=LAYOUT.namespace_name,
        start_block=first,
        block_size=64,
    )


def store_tail(client: CacheClient, tail: Tail) -> None:
    """Store a prompt's partial last group (two service blocks of any bytes) as P would."""
    answer = client.store(
        "m",
        tail.tokens,
        [b"tail piece 0", b"tail piece 1"],
        kv_layout=LAYOUT.namespace_name,
        start_block=0,
        block_size=64,
        salt=tail.namespace.salt,
        retention=tail.namespace.retention or None,
    )
    assert answer.stored_blocks == 2


NONCE = "0123456789abcdef0123456789abcdef"


def handed_off(tokens: list[int], nonce: str = NONCE) -> dict[str, Any]:
    """The params a prefill engine reports for PROMPT-token `tokens`: 4 groups and the rest."""
    return report(4 * GROUP, tail_tokens=PROMPT - 4 * GROUP, tail_nonce=nonce)


def the_tail(tokens: list[int], nonce: str, retention: str = "handoff") -> Tail:
    """The partial last group of `tokens` under `nonce`, in the tests' namespace, of the
    service's built-in class for such groups."""
    tail = tail_of(
        tokens, group_tokens=GROUP, nonce=nonce, namespace=namespace(), retention=retention
    )
    assert tail is not None
    return tail


def test_a_prefill_request_stores_its_last_group_apart_and_reports_it(
    make_side: MakeSide, client: CacheClient, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    store(client, tokens, 2)  # the first group is held already
    side = make_side()
    assert side.matched_tokens(PromptRequest("p", tokens, kv_transfer_params=PREFILL), 0) == GROUP
    side.allocated("p", [1, 2, 3, 4, 5], GROUP)
    loaded = ScheduledRequest("p", [1, 2, 3, 4, 5], True, GROUP, PROMPT - GROUP)
    # Groups 1-3 under the prompt's keys, then the last group under the request's own
    groups, tail = side.plan_step([loaded]).stores
    assert (groups.first_group, groups.block_ids) == (1, [2, 3, 4])
    answer = side.finished("p")
    assert answer is not None
    nonce = answer["prompt_cache"]["tail_nonce"]
    assert answer == report(4 * GROUP, tail_tokens=PROMPT - 4 * GROUP, tail_nonce=nonce)
    assert len(nonce) == 32 and int(nonce, 16) >= 0
    expected = the_tail(tokens, nonce)
    assert tail == StoreTask("p", expected.namespace, 0, expected.tokens, [5])
    assert tail.namespace.salt.startswith("pd-tail.")
    assert tail.namespace.retention == "handoff"  # the service's 10 minutes, not the request's
    assert groups.namespace.retention == ""
    assert tail.tokens == tokens[4 * GROUP :] + [0] * (5 * GROUP - PROMPT)


def test_a_service_without_the_handoff_class_keeps_the_last_group_as_its_request_and_says_so(
    tmp_path: Path, counters: Counters, prompts: Prompts, caplog: pytest.LogCaptureFixture
) -> None:
    with side_on_own_service(tmp_path, counters, retention="agent=3d,chat=7d") as (side, _, _):
        tokens = prompts(PROMPT)
        with caplog.at_level(logging.WARNING, logger="vllm.prompt_cache_connector"):
            side.matched_tokens(PromptRequest("p", tokens, kv_transfer_params=PREFILL), 0)
        _, tail = side.plan_step([prefill("p", [1, 2, 3, 4, 5], PROMPT)]).stores
    assert tail.namespace.salt.startswith("pd-tail.") and tail.namespace.retention == ""
    assert "no retention class 'handoff' (handoff_retention)" in caplog.text
    assert "Add handoff=10m to the service's --retention" in caplog.text


def test_a_prefill_requests_last_group_is_stored_once_its_prompt_is_computed(
    make_side: MakeSide, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    side = make_side()
    side.matched_tokens(PromptRequest("p", tokens, kv_transfer_params=PREFILL), 0)
    first = side.plan_step([prefill("p", [1, 2, 3, 4, 5], 512)])  # a chunk: 4 groups
    assert [task.first_group for task in first.stores] == [0]
    last = ScheduledRequest("p", None, False, 512, PROMPT - 512)
    (tail,) = side.plan_step([last]).stores
    assert tail.block_ids == [5] and tail.namespace.salt.startswith("pd-tail.")
    assert side.plan_step([ScheduledRequest("p", None, False, PROMPT, 1)]).stores == []


def test_a_last_group_of_several_engine_blocks_fills_in_the_unallocated_ones(
    make_side: MakeSide, prompts: Prompts
) -> None:
    small = dataclasses.replace(LAYOUT, engine_block_tokens=32)  # groups of 64: 2 blocks
    tokens = prompts(200)  # 3 whole groups and 8 tokens: one block of the last group
    side = make_side(layout=small)
    side.matched_tokens(PromptRequest("p", tokens, kv_transfer_params=PREFILL), 0)
    blocks = [10, 11, 12, 13, 14, 15, 16]
    _, tail = side.plan_step([prefill("p", blocks, 200)]).stores
    assert tail.block_ids == [16, 16]
    assert len(tail.tokens) == 64 and tail.tokens[8:] == [0] * 56


def test_a_prompt_ending_on_a_group_boundary_has_no_last_group_to_store(
    make_side: MakeSide, prompts: Prompts
) -> None:
    tokens = prompts(4 * GROUP)
    side = make_side()
    side.matched_tokens(PromptRequest("p", tokens, kv_transfer_params=PREFILL), 0)
    (task,) = side.plan_step([prefill("p", [1, 2, 3, 4], 4 * GROUP)]).stores
    assert task.first_group == 0
    assert side.finished("p") == report(4 * GROUP)


def test_a_decode_engine_loads_the_whole_prompt_with_the_last_group_apart(
    make_side: MakeSide, client: CacheClient, counters: Counters, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    keys = store(client, tokens, 8)
    tail = the_tail(tokens, NONCE)
    store_tail(client, tail)
    side = make_side(role_store=False, load_mode="async")
    request = PromptRequest("d", tokens, kv_transfer_params=handed_off(tokens))
    assert side.matched_tokens(request, GROUP) == PROMPT - GROUP  # vLLM holds the first group
    side.allocated("d", [1, 2, 3, 4, 5], PROMPT - GROUP)
    groups, last = side.plan_step([]).loads
    assert (groups.block_ids, groups.keys, groups.skip) == ([2, 3, 4], keys[2:8], 0)
    assert (last.namespace, last.block_ids, last.skip) == (tail.namespace, [5], 0)
    assert len(last.keys) == 2
    assert counters.totals()["hit_tokens"] == PROMPT - GROUP


def test_a_last_group_of_another_prompt_or_nonce_is_never_offered(
    make_side: MakeSide, client: CacheClient, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    store(client, tokens, 8)
    store_tail(client, the_tail(tokens, NONCE))
    other = [*tokens[:-1], tokens[-1] + 1]  # the same whole groups, another last token
    store_tail(client, the_tail(other, "f" * 32))
    side = make_side(role_store=False, load_mode="async", prefill_wait_seconds=0.2)
    for request_id, prompt, nonce in (("a", other, NONCE), ("b", tokens, "f" * 32)):
        request = PromptRequest(request_id, prompt, kv_transfer_params=handed_off(prompt, nonce))
        assert side.matched_tokens(request, 0) == 4 * GROUP


def test_a_report_of_another_last_group_length_is_not_waited_for(
    make_side: MakeSide, client: CacheClient, counters: Counters, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    store(client, tokens, 8)
    side = make_side(role_store=False, load_mode="async", prefill_wait_seconds=5.0)
    params = report(4 * GROUP, tail_tokens=PROMPT - 4 * GROUP + 1, tail_nonce=NONCE)
    started = time.monotonic()
    assert side.matched_tokens(PromptRequest("d", tokens, kv_transfer_params=params), 0) == 512
    assert time.monotonic() - started < 2.0  # not the 5 s a missing group would be waited for
    assert counters.totals()["miss_prefill_other_prompt"] == 1


def test_a_synchronous_load_never_takes_the_last_group(
    make_side: MakeSide, client: CacheClient, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    store(client, tokens, 8)
    store_tail(client, the_tail(tokens, NONCE))
    side = make_side(role_store=False, load_mode="sync")
    request = PromptRequest("d", tokens, kv_transfer_params=handed_off(tokens))
    assert side.matched_tokens(request, 0) == 4 * GROUP


def test_a_decode_engine_waits_for_the_last_group_too(
    make_side: MakeSide, client: CacheClient, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    store(client, tokens, 8)
    landing = threading.Timer(0.3, lambda: store_tail(client, the_tail(tokens, NONCE)))
    landing.start()
    side = make_side(role_store=False, load_mode="async")
    request = PromptRequest("d", tokens, kv_transfer_params=handed_off(tokens))
    assert side.matched_tokens(request, 0) == PROMPT
    landing.join()


def test_only_a_prefill_request_of_a_storing_engine_reports(
    make_side: MakeSide, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    plain = make_side()
    plain.matched_tokens(PromptRequest("r", tokens), 0)
    plain.plan_step([prefill("r", [1, 2, 3, 4, 5], PROMPT)])
    assert plain.finished("r") is None
    consumer = make_side(role_store=False)
    consumer.matched_tokens(PromptRequest("p", tokens, kv_transfer_params=PREFILL), 0)
    consumer.plan_step([prefill("p", [1, 2, 3, 4, 5], PROMPT)])
    assert consumer.finished("p") is None


def test_a_prefill_request_that_may_not_store_reports_nothing_stored(
    make_side: MakeSide, prompts: Prompts
) -> None:
    params = {**PREFILL, "prompt_cache": {"store": False}}
    side = make_side()
    side.matched_tokens(PromptRequest("p", prompts(PROMPT), kv_transfer_params=params), 0)
    side.plan_step([prefill("p", [1, 2, 3, 4, 5], PROMPT)])
    assert side.finished("p") == report(0)


def test_a_decode_engine_waits_for_the_prefill_engines_stores_to_land(
    make_side: MakeSide, client: CacheClient, counters: Counters, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    store(client, tokens, 2)
    # The prefill engine's last groups land 0.3 s after its answer reached the decode engine
    landing = threading.Timer(0.3, lambda: store_more(client, tokens, 2, 8))
    landing.start()
    side = make_side(role_store=False, load_mode="async")
    started = time.monotonic()
    request = PromptRequest("d", tokens, kv_transfer_params=report(4 * GROUP))
    assert side.matched_tokens(request, 0) == 4 * GROUP
    landing.join()
    assert 0.25 < time.monotonic() - started < 3.0
    totals = counters.totals()
    assert totals["prefill_waits"] == 1 and totals["prefill_wait_seconds"] >= 0.25
    assert totals["lookups"] == 1
    assert not any(name.startswith("miss_") for name in totals)


def test_a_decode_engine_that_holds_the_reported_tokens_does_not_wait(
    make_side: MakeSide, client: CacheClient, counters: Counters, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    store(client, tokens, 8)
    side = make_side(role_store=False)
    request = PromptRequest("d", tokens, kv_transfer_params=report(4 * GROUP))
    assert side.matched_tokens(request, 0) == 4 * GROUP
    assert "prefill_waits" not in counters.totals()


def test_stores_that_never_land_are_waited_for_no_longer_than_the_bound(
    make_side: MakeSide, client: CacheClient, counters: Counters, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    store(client, tokens, 4)  # two groups of the four reported
    side = make_side(role_store=False, prefill_wait_seconds=0.4)
    started = time.monotonic()
    request = PromptRequest("d", tokens, kv_transfer_params=report(4 * GROUP))
    assert side.matched_tokens(request, 0) == 2 * GROUP  # what is there loads
    assert time.monotonic() - started < 2.0
    assert counters.totals()["miss_prefill_not_stored"] == 4  # service blocks of 64


def test_a_report_past_the_prompt_waits_only_for_the_prompts_blocks(
    make_side: MakeSide, client: CacheClient, counters: Counters, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    store(client, tokens, 9)  # every whole service block of the prompt
    side = make_side(role_store=False, load_mode="async")
    request = PromptRequest("d", tokens, kv_transfer_params=report(10_000))
    assert side.matched_tokens(request, 0) == 4 * GROUP
    assert "prefill_waits" not in counters.totals()


def test_the_scheduler_keeps_scheduling_while_a_decode_engine_waits(
    make_side: MakeSide, client: CacheClient, prompts: Prompts
) -> None:
    tokens = prompts(PROMPT)
    side = make_side(role_store=False, lookup_wait_seconds=0.01, prefill_wait_seconds=2.0)
    request = PromptRequest("d", tokens, kv_transfer_params=report(4 * GROUP))
    started = time.monotonic()
    assert side.matched_tokens(request, 0) is None  # "ask again later"
    assert time.monotonic() - started < 0.5
    store_more(client, tokens, 0, 8)
    deadline = time.monotonic() + 5.0
    while (matched := side.matched_tokens(request, 0)) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert matched == 4 * GROUP


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"do_remote_decode": "yes"}, "do_remote_decode"),
        ({"prompt_cache": {"stored_tokens": -1}}, "stored_tokens"),
        ({"prompt_cache": {"stored_tokens": True}}, "stored_tokens"),
        ({"prompt_cache": {"stored_tokens": 1.5}}, "stored_tokens"),
        ({"prompt_cache": {"tail_tokens": -3}}, "tail_tokens"),
        ({"prompt_cache": {"tail_nonce": "not hex"}}, "tail_nonce"),
        ({"prompt_cache": {"tail_nonce": "A" * 32}}, "tail_nonce"),
        ({"prompt_cache": {"tail_nonce": 7}}, "tail_nonce"),
    ],
)
def test_bad_hand_off_params_are_refused_by_name(params: dict[str, Any], field: str) -> None:
    with pytest.raises(OptionError, match=field):
        RequestOptions.from_params(params)


def test_the_hand_off_params_are_read() -> None:
    assert RequestOptions.from_params(PREFILL).remote_decode
    assert RequestOptions.from_params(report(256)).stored_tokens == 256
