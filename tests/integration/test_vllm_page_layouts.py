"""The connector's page seam on every KV cache layout vLLM 0.32 lays out, against a real
service, without vLLM: caches laid out exactly as vLLM lays them (shapes, strides and offsets
recorded from vLLM's own `create_kv_cache_views` in tests/fixtures/vllm_kv_views.json, by
tests/vllm/kv_views.py), a request stored from one cache loads into another laid out the same,
page for page per (layer, block), over HTTP and from the store's files; no other block is
written. A layout whose pages are not one run of bytes is refused, naming the layout. Both
copies run: the host one (in place) and the GPU one's staging (`DevicePages`, here without
streams, on host tensors: its bytes, not its CUDA ordering, which bench/gpu/cuda_check.py checks
on a GPU)."""

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
from bench.gpu.cuda_check import fixture_caches, one_run, page_of  # noqa: E402
from cache_service.integrations.vllm.device_pages import DevicePages, Unstreamed  # noqa: E402
from cache_service.integrations.vllm.worker_side import WorkerSide, page_copy  # noqa: E402

pytestmark = pytest.mark.integration

VIEWS = json.loads(
    (Path(__file__).parents[1] / "fixtures" / "vllm_kv_views.json").read_text(encoding="utf-8")
)
SERVICE_BLOCK = 16
# The staged copy a block at a time, so that its chunks are exercised too.
COPIES = {"host": page_copy, "staged": lambda v: DevicePages(v, Unstreamed(), chunk_bytes=1)}


def _entries(*, refused_by_us: bool) -> list[Any]:
    """(case, layout entry) pairs vLLM builds views for; those with pages of one byte run, or
    (refused_by_us) those without."""
    params = []
    for case, spec in VIEWS["cases"].items():
        for entry in spec["layouts"]:
            if "refused" in entry:  # vLLM itself refuses (kernel blocks in B-outer layouts)
                continue
            if one_run(entry) != refused_by_us:
                params.append(pytest.param(case, entry, id=f"{case}-{entry['layout']}"))
    return params


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


def _worker(
    url: str, layout: Any, caches: dict[str, Any], stack: ExitStack, copy: str = "host", **kw: Any
) -> Any:
    client = stack.enter_context(CacheClient(url, fail_open=True, **kw))
    worker = WorkerSide(
        layout=layout,
        client=client,
        store_client=stack.enter_context(CacheClient(url, fail_open=True)),
        counters=Counters(),
        store_queue_bytes=1 << 30,
        store_request_bytes=64 << 20,
        copier=COPIES[copy],
    )
    stack.callback(worker.shutdown)
    worker.register(caches, num_blocks=VIEWS["cases"]["gqa-bf16"]["layouts"][0]["num_blocks"])
    return worker


@pytest.mark.parametrize("copy", list(COPIES))
@pytest.mark.parametrize("local_reads", [False, True], ids=["http", "local-reads"])
@pytest.mark.parametrize(("case", "entry"), _entries(refused_by_us=False))
def test_every_block_compact_layout_loads_page_for_page(
    server: ServerProcess, case: str, entry: dict[str, Any], local_reads: bool, copy: str
) -> None:
    layout = _layout(case, entry)
    blocks = entry["num_blocks"]
    group_tokens = max(SERVICE_BLOCK, layout.engine_block_tokens)
    tokens = list(range(3000, 3000 + 3 * group_tokens))
    source_ids, target_ids = [1, 4, 6], [7, 2, 5]
    source, target = fixture_caches(entry, "cpu", seed=11), fixture_caches(entry, "cpu", seed=None)
    namespace = Namespace(layout.model, layout.namespace_name, salt="", retention="")
    with ExitStack() as stack:
        storing = _worker(server.url, layout, source, stack, copy)
        assert storing.enabled, storing.refusal
        stored = StoreTask("s", namespace, first_group=0, tokens=tokens, block_ids=source_ids)
        storing.save(StepPlan(SERVICE_BLOCK, stores=[stored]), skip=False)
        assert storing.wait_idle(30)
        with CacheClient(server.url) as client:
            keys = client.lookup(
                layout.model, tokens, kv_layout=layout.namespace_name, block_size=SERVICE_BLOCK
            ).keys
        loading = _worker(server.url, layout, target, stack, copy, local_reads=local_reads)
        task = LoadTask(
            "l", namespace, first_group=0, keys=list(keys), block_ids=target_ids, skip=0
        )
        assert loading.load(StepPlan(SERVICE_BLOCK, loads=[task])) == set()
    for name in source:
        for src, dst in zip(source_ids, target_ids, strict=True):
            assert page_of(target[name], dst, blocks) == page_of(source[name], src, blocks)
        for other in set(range(blocks)) - set(target_ids):
            assert not any(page_of(target[name], other, blocks))


@pytest.mark.parametrize(("case", "entry"), _entries(refused_by_us=True))
def test_a_layout_whose_pages_are_cut_is_refused_naming_it(
    server: ServerProcess, case: str, entry: dict[str, Any]
) -> None:
    layout = _layout(case, entry)
    with ExitStack() as stack:
        worker = _worker(server.url, layout, fixture_caches(entry, "cpu", seed=None), stack)
        assert not worker.enabled
        assert entry["layout"] in worker.refusal and "one dense run" in worker.refusal
