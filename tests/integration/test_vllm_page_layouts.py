"""The connector's page seam on every KV cache layout vLLM 0.32 lays out, against a real
service, without vLLM: caches laid out exactly as vLLM lays them (shapes, strides and offsets
recorded from vLLM's own `create_kv_cache_views` in tests/fixtures/vllm_kv_views.json, by
tests/vllm/kv_views.py), a request stored from one cache loads into another laid out the same,
page for page per (layer, block), over HTTP and from the store's files; no other block is
written. A layout whose pages are not one run of bytes is refused, naming the layout."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from cache_service.client import CacheClient
from cache_service.integrations.vllm.counters import Counters
from cache_service.integrations.vllm.plan import LoadTask, Namespace, StepPlan, StoreTask
from tests.integration.conftest import ServerProcess
from tests.vllm_layout import TEST_LAYOUT

torch = pytest.importorskip("torch")  # the [model] extra (README's command)
from cache_service.integrations.vllm.worker_side import WorkerSide  # noqa: E402

pytestmark = pytest.mark.integration

VIEWS = json.loads(
    (Path(__file__).parents[1] / "fixtures" / "vllm_kv_views.json").read_text(encoding="utf-8")
)
SERVICE_BLOCK = 16


def _entries(*, refused_by_us: bool) -> list[Any]:
    """(case, layout entry) pairs vLLM builds views for; those with pages of one byte run, or
    (refused_by_us) those without."""
    params = []
    for case, spec in VIEWS["cases"].items():
        for entry in spec["layouts"]:
            if "refused" in entry:  # vLLM itself refuses (kernel blocks in B-outer layouts)
                continue
            one_run = _one_run(entry)
            if one_run != refused_by_us:
                params.append(pytest.param(case, entry, id=f"{case}-{entry['layout']}"))
    return params


def _one_run(entry: dict[str, Any]) -> bool:
    """Whether every page is one dense run (the fixture's strides, independently of ours)."""
    view = entry["views"][0]
    dims = sorted(zip(view["shape"][1:], view["stride"][1:], strict=True), key=lambda d: d[1])
    expected = 1
    for size, stride in dims:
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _caches(entry: dict[str, Any], seed: int | None) -> dict[str, Any]:
    """A raw buffer laid out as vLLM lays it: random bytes, or zeros when seed is None."""
    raw = torch.zeros(entry["buffer_bytes"], dtype=torch.uint8)
    if seed is not None:
        raw.random_(0, 256, generator=torch.Generator().manual_seed(seed))
    caches = {}
    for view in entry["views"]:
        typed = raw.view(getattr(torch, view["dtype"]))
        caches[view["name"]] = torch.as_strided(
            typed, view["shape"], view["stride"], view["storage_offset"]
        )
    return caches


def _layout(case: str, entry: dict[str, Any]) -> Any:
    spec = VIEWS["cases"][case]
    layers = len(entry["views"])
    return dataclasses.replace(
        TEST_LAYOUT,
        backend="TEST",
        kv_cache_layout=entry["layout"],
        layers=layers,
        engine_block_tokens=spec["block_size"],
        block_bytes=entry["page_size_bytes"] * layers,
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One service for every layout (each layout's blocks sit in a namespace of their own)."""
    folder = tmp_path_factory.mktemp("page-layouts")
    service = ServerProcess(
        folder / "data",
        folder / "service.log",
        local_reads="true",
        model_block_size=f"{TEST_LAYOUT.model}={SERVICE_BLOCK}",
    )
    service.start()
    try:
        yield service
    finally:
        service.stop()


def _worker(url: str, layout: Any, caches: dict[str, Any], stack: ExitStack, **kw: Any) -> Any:
    client = stack.enter_context(CacheClient(url, fail_open=True, **kw))
    worker = WorkerSide(
        layout=layout,
        client=client,
        store_client=stack.enter_context(CacheClient(url, fail_open=True)),
        counters=Counters(),
        store_queue_bytes=1 << 30,
        store_request_bytes=64 << 20,
    )
    stack.callback(worker.shutdown)
    worker.register(caches, num_blocks=VIEWS["cases"]["gqa-bf16"]["layouts"][0]["num_blocks"])
    return worker


def _page(cache: Any, block: int, blocks: int) -> bytes:
    """One layer's page of one vLLM block, read through the logical view (not our seam)."""
    kernel = cache.shape[0] // blocks
    return b"".join(
        cache[block * kernel + k].contiguous().view(torch.uint8).numpy().tobytes()
        for k in range(kernel)
    )


@pytest.mark.parametrize("local_reads", [False, True], ids=["http", "local-reads"])
@pytest.mark.parametrize(("case", "entry"), _entries(refused_by_us=False))
def test_every_block_compact_layout_loads_page_for_page(
    server: ServerProcess, case: str, entry: dict[str, Any], local_reads: bool
) -> None:
    layout = _layout(case, entry)
    blocks = entry["num_blocks"]
    group_tokens = max(SERVICE_BLOCK, layout.engine_block_tokens)
    tokens = list(range(3000, 3000 + 3 * group_tokens))
    source_ids, target_ids = [1, 4, 6], [7, 2, 5]
    source, target = _caches(entry, seed=11), _caches(entry, seed=None)
    namespace = Namespace(layout.model, layout.namespace_name, salt="", retention="")
    with ExitStack() as stack:
        storing = _worker(server.url, layout, source, stack)
        assert storing.enabled, storing.refusal
        stored = StoreTask("s", namespace, first_group=0, tokens=tokens, block_ids=source_ids)
        storing.save(StepPlan(SERVICE_BLOCK, stores=[stored]), skip=False)
        assert storing.wait_idle(30)
        with CacheClient(server.url) as client:
            keys = client.lookup(
                layout.model, tokens, kv_layout=layout.namespace_name, block_size=SERVICE_BLOCK
            ).keys
        loading = _worker(server.url, layout, target, stack, local_reads=local_reads)
        task = LoadTask(
            "l", namespace, first_group=0, keys=list(keys), block_ids=target_ids, skip=0
        )
        assert loading.load(StepPlan(SERVICE_BLOCK, loads=[task])) == set()
    for name in source:
        for src, dst in zip(source_ids, target_ids, strict=True):
            assert _page(target[name], dst, blocks) == _page(source[name], src, blocks)
        for other in set(range(blocks)) - set(target_ids):
            assert not any(_page(target[name], other, blocks))


@pytest.mark.parametrize(("case", "entry"), _entries(refused_by_us=True))
def test_a_layout_whose_pages_are_cut_is_refused_naming_it(
    server: ServerProcess, case: str, entry: dict[str, Any]
) -> None:
    layout = _layout(case, entry)
    with ExitStack() as stack:
        worker = _worker(server.url, layout, _caches(entry, seed=None), stack)
        assert not worker.enabled
        assert entry["layout"] in worker.refusal and "one dense run" in worker.refusal
