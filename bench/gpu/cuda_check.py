"""The vLLM connector's GPU page copy against a real service, on one GPU without vLLM.

The check for a machine with CUDA torch and no vLLM (docs/content/vllm-connector.md, "What runs
where"). It starts `cache-service serve` on 127.0.0.1 (with same-host reads) and drives the
connector's worker half (`WorkerSide`) over caches in GPU memory:

1. **Bytes**: every block-compact layout of tests/fixtures/vllm_kv_views.json (vLLM 0.32's own
   `create_kv_cache_views`: GQA bf16 and fp8, MLA, MLA in kernel blocks), laid out in device
   memory exactly as vLLM lays it, is stored from one cache and loaded into another at other
   block ids, over HTTP and same-host reads, synchronously and asynchronously: page for page
   per (layer, block), every other block still zero; and the stored KV equals what the same
   content stores from a host cache.
2. **Order**: a store called behind a slow kernel and a fill of its pages stores the filled
   bytes; a load called behind a slow kernel and a zeroing of its blocks (as vLLM zeroes new
   blocks) lands after the zeroing, synchronous and asynchronous.
3. **No host sync** in `save()`, in `load_async()` (the start of an asynchronous load) or in a
   synchronous `load()`: each runs under `torch.cuda.set_sync_debug_mode("error")`.
4. **Speed**: a request of `--tokens` (4,096) of an 8B-like model (32 layers, 8 KV heads of
   128, bf16, blocks of 16: 128 KiB a token) in vLLM's CUDA default layout (LBNHC): the copy
   out (gather and device-to-host) and in (staging, host-to-device, `index_copy_`) in GB/s,
   the time each call holds the calling thread, and a store and a load through the service.

Prints each step and writes JSON (`--out`; under `$OUT` when set, as the device tool runs it).
On a GPU machine without this project installed, `bash bench/gpu/run.sh` installs it beside
that machine's torch from wheels carried along (`bash bench/gpu/wheelhouse.sh` here), then runs
this. With `--device cpu` the bytes and speed steps run on host tensors through both host
copies (in place, and the GPU copy's staging without streams), which is how tests/integration
runs this script without a GPU; order and host syncs need CUDA and are reported as not run.

    python -m bench.gpu.cuda_check [--device cuda|cpu] [--tokens 4096] [--rounds 5] [--out F]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.services import fetch_requests, our_service
from cache_service.client import CacheClient
from cache_service.integrations.vllm.counters import Counters
from cache_service.integrations.vllm.device_pages import DevicePages, Unstreamed
from cache_service.integrations.vllm.layout import EngineLayout
from cache_service.integrations.vllm.paged import PageCopy, PageView, page_views
from cache_service.integrations.vllm.plan import LoadTask, Namespace, StepPlan, StoreTask
from cache_service.integrations.vllm.worker_side import WorkerSide, page_copy

REPO = Path(__file__).resolve().parents[2]
VIEWS = json.loads((REPO / "tests/fixtures/vllm_kv_views.json").read_text(encoding="utf-8"))
SERVICE_BLOCK = 16
MODEL = "cuda-check"
SLEEP_CYCLES = 200_000_000  # torch.cuda._sleep: about 0.1 s on a 1.7-2 GHz GPU
Copier = Callable[[Sequence[PageView]], PageCopy]


def _copiers(device: str) -> dict[str, Copier]:
    """The page copies to check: the connector's own for the device; on hosts also the GPU
    copy's staging without streams."""
    if device == "cpu":
        return {"host": page_copy, "staged": lambda views: DevicePages(views, Unstreamed())}
    return {"device": page_copy}


def _say(text: str) -> None:
    print(f"cuda_check: {text}", flush=True)


# Caches ------------------------------------------------------------------------------------


def fixture_caches(entry: dict[str, Any], device: str, seed: int | None) -> dict[str, Any]:
    """One raw int8 buffer laid out as vLLM lays it (the fixture's views): random or zero."""
    raw = torch.zeros(entry["buffer_bytes"], dtype=torch.uint8, device=device)
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
        raw.random_(0, 256, generator=generator)
    return {
        view["name"]: torch.as_strided(
            raw.view(getattr(torch, view["dtype"])),
            view["shape"],
            view["stride"],
            view["storage_offset"],
        )
        for view in entry["views"]
    }


def lbnhc_caches(
    layers: int, blocks: int, heads: int, head_size: int, *, block: int, device: str
) -> dict[str, Any]:
    """An 8B-like bf16 cache in the LBNHC layout (CUDA's default): per layer a logical
    `[blocks, heads, tokens, 2 * head size]` view whose page stores tokens outside heads."""
    page = block * heads * 2 * head_size
    raw = torch.zeros(layers * blocks * page, dtype=torch.bfloat16, device=device)
    return {
        f"layer.{layer}": raw[layer * blocks * page : (layer + 1) * blocks * page]
        .view(blocks, block, heads, 2 * head_size)
        .permute(0, 2, 1, 3)
        for layer in range(layers)
    }


def _layout(name: str, device: str, *, layers: int, block: int, block_bytes: int) -> EngineLayout:
    return EngineLayout(
        model=MODEL,
        weights="cuda-check",
        engine_version="0.32.0",
        device=device,
        backend="CHECK",
        kv_cache_layout=name,
        isa="",
        kv_dtype="bytes",
        layers=layers,
        kv_heads=1,
        head_size=1,
        engine_block_tokens=block,
        block_bytes=block_bytes,
    )


def page_of(cache: Any, block: int, blocks: int) -> bytes:
    """One layer's page of one vLLM block, read through the logical view (not the seam)."""
    kernel = cache.shape[0] // blocks
    return b"".join(
        cache[block * kernel + k].contiguous().view(torch.uint8).cpu().numpy().tobytes()
        for k in range(kernel)
    )


# The worker against the service ------------------------------------------------------------


class Pair:
    """A storing and a loading worker half on one service, and the plans that drive them."""

    def __init__(self, url: str, layout: EngineLayout, stack: ExitStack, **kw: Any) -> None:
        self.url, self.layout = url, layout
        self.namespace = Namespace(layout.model, layout.namespace_name, salt="", retention="")
        self.group_tokens = max(SERVICE_BLOCK, layout.engine_block_tokens)
        self._stack = stack
        self._kw = kw

    def worker(self, caches: dict[str, Any], blocks: int, copier: Copier, **kw: Any) -> Any:
        """A worker half over `caches`, shut down with the pair."""
        client = self._stack.enter_context(CacheClient(self.url, fail_open=True, **kw))
        worker = WorkerSide(
            layout=self.layout,
            client=client,
            store_client=self._stack.enter_context(CacheClient(self.url, fail_open=True)),
            counters=Counters(),
            store_queue_bytes=4 << 30,
            store_request_bytes=64 << 20,
            copier=copier,
        )
        self._stack.callback(worker.shutdown)
        worker.register(caches, num_blocks=blocks)
        if not worker.enabled:
            raise SystemExit(f"the worker refused the caches: {worker.refusal}")
        return worker

    def tokens(self, groups: int, seed: int) -> list[int]:
        """A prompt of `groups` whole groups, distinct per seed."""
        return [seed * 100_000 + i for i in range(groups * self.group_tokens)]

    def store_plan(self, tokens: list[int], block_ids: list[int]) -> StepPlan:
        """Store `tokens` from `block_ids`."""
        task = StoreTask("s", self.namespace, first_group=0, tokens=tokens, block_ids=block_ids)
        return StepPlan(SERVICE_BLOCK, stores=[task])

    def load_plan(self, tokens: list[int], block_ids: list[int]) -> StepPlan:
        """Load what the service holds of `tokens` into `block_ids`."""
        with CacheClient(self.url) as client:
            keys = client.lookup(
                self.layout.model,
                tokens,
                kv_layout=self.layout.namespace_name,
                block_size=SERVICE_BLOCK,
            ).keys
        task = LoadTask("l", self.namespace, 0, keys=list(keys), block_ids=block_ids, skip=0)
        return StepPlan(SERVICE_BLOCK, loads=[task])

    def stored_kv(self, tokens: list[int]) -> list[bytes]:
        """The stored pieces of `tokens` without their headers (which name the device)."""
        pieces: dict[int, bytes] = {}

        def keep(index: int, payload: bytes | memoryview | None) -> None:
            assert payload is not None, "a stored piece is missing"
            header = struct.unpack_from("<4sHH", payload)[2]
            pieces[index] = bytes(payload[8 + header :])

        with CacheClient(self.url) as client:
            keys = client.lookup(
                self.layout.model, tokens, kv_layout=self.layout.namespace_name,
                block_size=SERVICE_BLOCK,
            ).keys  # fmt: skip
            client.read_blocks(
                self.layout.model, keys, keep, kv_layout=self.layout.namespace_name, salt=""
            )
        return [pieces[i] for i in sorted(pieces)]


def load(worker: Any, plan: StepPlan, mode: str) -> set[str]:
    """Load `plan` synchronously or asynchronously; the failed requests."""
    if mode == "sync":
        return set(worker.load(plan))
    worker.load_async(plan)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done = worker.finished_loads()
        if done:
            failed = worker.take_failed_blocks()
            return set(done) if failed else set()
        time.sleep(0.001)
    raise SystemExit("an asynchronous load did not finish in 60 s")


# Steps -------------------------------------------------------------------------------------


def check_bytes(url: str, device: str) -> dict[str, Any]:
    """Step 1: every block-compact layout, page for page, both ways and modes."""
    results: dict[str, Any] = {}
    for case, spec in VIEWS["cases"].items():
        for entry in spec["layouts"]:
            if "refused" in entry or not one_run(entry):
                continue
            for copy, copier in _copiers(device).items():
                name = f"{case}-{entry['layout']}-{copy}"
                results[name] = _one_layout(url, device, name, spec, entry, copier=copier)
                _say(f"bytes {name}: {results[name]}")
    return results


def _one_layout(url: str, device: str, name: str, spec: Any, entry: Any, *, copier: Copier) -> str:
    """One layout through one copy (its own namespace `name`); what was checked."""
    blocks, layers = entry["num_blocks"], len(entry["views"])
    layout = _layout(
        name, device, layers=layers, block=spec["block_size"],
        block_bytes=entry["page_size_bytes"] * layers,
    )  # fmt: skip
    source = fixture_caches(entry, device, seed=11)
    source_ids = [1, 4, 6]
    outcomes = []
    with ExitStack() as stack:
        pair = Pair(url, layout, stack)
        tokens = pair.tokens(3, seed=1)
        storing = pair.worker(source, blocks, copier)
        storing.save(pair.store_plan(tokens, source_ids), skip=False)
        assert storing.wait_idle(60)
        host_kv = _host_store(url, name, spec, entry, source=source, tokens=tokens)
        if pair.stored_kv(tokens) != host_kv:
            raise SystemExit(f"{entry['layout']}: the stored KV differs from a host cache's")
        for local_reads in (False, True):
            for mode in ("sync", "async"):
                target = fixture_caches(entry, device, seed=None)
                target_ids = [7, 2, 5]
                fetched = fetch_requests(url)
                with ExitStack() as one:  # LMDB opens a folder once a process: one reader
                    loading = Pair(url, layout, one).worker(
                        target, blocks, copier, local_reads=local_reads
                    )
                    failed = load(loading, pair.load_plan(tokens, target_ids), mode)
                if failed:
                    raise SystemExit(f"{entry['layout']} {mode}: the load failed")
                if local_reads and fetch_requests(url) != fetched:
                    raise SystemExit(f"{entry['layout']}: same-host reads came over HTTP")
                _same_pages(source, target, source_ids, target_ids, blocks)
                outcomes.append(f"{'local' if local_reads else 'http'}/{mode}")
    return "ok " + " ".join(outcomes)


def _host_store(
    url: str, name: str, spec: Any, entry: Any, *, source: Any, tokens: list[int]
) -> list[bytes]:
    """The KV a host cache of the same content stores (under a namespace of its own)."""
    layers = len(entry["views"])
    layout = _layout(
        f"host-{name}",
        "cpu",
        layers=layers,
        block=spec["block_size"],
        block_bytes=entry["page_size_bytes"] * layers,
    )
    host = fixture_caches(entry, "cpu", seed=None)
    for layer, cache in source.items():  # the same bytes, in the same layout, on the host
        host[layer].copy_(cache.cpu())
    with ExitStack() as stack:
        pair = Pair(url, layout, stack)
        worker = pair.worker(host, entry["num_blocks"], page_copy)
        worker.save(pair.store_plan(tokens, [1, 4, 6]), skip=False)
        assert worker.wait_idle(60)
        return pair.stored_kv(tokens)


def _same_pages(
    source: Any, target: Any, source_ids: list[int], target_ids: list[int], blocks: int
) -> None:
    """Each target page equals its source page; every other target page is still zero."""
    for name in source:
        for src, dst in zip(source_ids, target_ids, strict=True):
            if page_of(target[name], dst, blocks) != page_of(source[name], src, blocks):
                raise SystemExit(f"{name}: block {dst} differs from the stored block {src}")
        for other in set(range(blocks)) - set(target_ids):
            if any(page_of(target[name], other, blocks)):
                raise SystemExit(f"{name}: block {other}, not loaded, was written")


def one_run(entry: dict[str, Any]) -> bool:
    """Whether every page of a fixture layout is one dense run (from its strides alone)."""
    view = entry["views"][0]
    dims = sorted(zip(view["shape"][1:], view["stride"][1:], strict=True), key=lambda d: d[1])
    expected = 1
    for size, stride in dims:
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


@contextmanager
def no_host_sync() -> Iterator[None]:
    """Any host sync inside raises (torch's sync debug mode)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def check_order(url: str) -> dict[str, Any]:
    """Steps 2 and 3 (CUDA): stores after the writes queued before them, loads after the
    zeroing queued before them, no host sync in either."""
    entry = next(e for e in VIEWS["cases"]["gqa-bf16"]["layouts"] if e["layout"] == "LBNHC")
    spec, blocks, layers = VIEWS["cases"]["gqa-bf16"], entry["num_blocks"], len(entry["views"])
    layout = _layout("order", "cuda", layers=layers, block=spec["block_size"],
                     block_bytes=entry["page_size_bytes"] * layers)  # fmt: skip
    result: dict[str, Any] = {}
    with ExitStack() as stack:
        pair = Pair(url, layout, stack)
        source = fixture_caches(entry, "cuda", seed=None)
        storing = pair.worker(source, blocks, page_copy)
        tokens = pair.tokens(3, seed=777)
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
        for cache in source.values():
            cache.view(torch.uint8).fill_(0x5A)  # queued behind the sleep
        started = time.perf_counter()
        with no_host_sync():
            storing.save(pair.store_plan(tokens, [1, 4, 6]), skip=False)
        result["save_call_ms"] = (time.perf_counter() - started) * 1e3
        assert storing.wait_idle(60)
        stored = pair.stored_kv(tokens)
        if not stored or any(set(piece) != {0x5A} for piece in stored):
            raise SystemExit("order: the store read the pages before the queued fill")
        result["store_after_fill"] = "ok"
        for mode in ("sync", "async"):
            target = fixture_caches(entry, "cuda", seed=5)  # not zero: the zeroing must show
            loading = pair.worker(target, blocks, page_copy)
            plan = pair.load_plan(tokens, [7, 2, 5])
            torch.cuda.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
            for cache in target.values():  # as vLLM zeroes new blocks before the forward
                for block in (7, 2, 5):
                    cache[block].zero_()
            started = time.perf_counter()
            with no_host_sync():
                if mode == "sync":
                    failed = loading.load(plan)
                else:
                    loading.load_async(plan)
            result[f"load_{mode}_call_ms"] = (time.perf_counter() - started) * 1e3
            if mode == "async":
                failed = load_finish(loading)
            torch.cuda.synchronize()
            if failed:
                raise SystemExit(f"order: the {mode} load failed")
            for name in source:
                for block in (7, 2, 5):
                    if set(page_of(target[name], block, blocks)) != {0x5A}:
                        raise SystemExit(f"order: a {mode} load landed before the zeroing")
            result[f"load_{mode}_after_zeroing"] = "ok"
    _say(f"order and host syncs: {result}")
    return result


def load_finish(worker: Any) -> set[str]:
    """Wait for an asynchronous load started already; the failed requests."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done = worker.finished_loads()
        if done:
            return set(done) if worker.take_failed_blocks() else set()
        time.sleep(0.001)
    raise SystemExit("an asynchronous load did not finish in 60 s")


def check_speed(url: str, device: str, tokens: int, rounds: int) -> dict[str, Any]:
    """Step 4: GB/s of the copy out and in for one request, and through the service."""
    layers, heads, head_size, block = 32, 8, 128, 16
    count = tokens // block
    caches = lbnhc_caches(layers, 2 * count + 2, heads, head_size, block=block, device=device)
    for cache in caches.values():
        cache.view(torch.uint8).random_(0, 256)
    views = page_views(caches, num_blocks=2 * count + 2, layout_name="LBNHC")
    source_ids = list(range(1, count + 1))
    target_ids = list(range(count + 1, 2 * count + 1))
    page_bytes = int(views[0].pages.shape[1])
    total = layers * count * page_bytes
    results: dict[str, Any] = {"tokens": tokens, "bytes": total, "layout": "LBNHC"}
    for copy, copier in _copiers(device).items():
        pages = copier(views)
        out, out_call, into, into_call, staging = [], [], [], [], []
        payload = os.urandom(page_bytes)
        for _ in range(rounds):
            _synchronize(device)
            started = time.perf_counter()
            gathered = pages.gather(source_ids)
            out_call.append(time.perf_counter() - started)
            gathered.wait()
            out.append(time.perf_counter() - started)
            started = time.perf_counter()
            landing = pages.landing(target_ids)
            written = np.frombuffer(payload, dtype=np.uint8)
            for block_id in target_ids:
                for layer in range(layers):
                    landing.write(layer, block_id, 0, written)
            staged = time.perf_counter()
            landing.land(count)
            into_call.append(time.perf_counter() - staged)
            _synchronize(device)
            into.append(time.perf_counter() - started)
            staging.append(staged - started)
        results[copy] = {
            "save_gb_s": total / statistics.median(out) / 1e9,
            "save_call_ms": statistics.median(out_call) * 1e3,
            "load_gb_s": total / statistics.median(into) / 1e9,
            "load_staging_ms": statistics.median(staging) * 1e3,
            "load_land_call_ms": statistics.median(into_call) * 1e3,
        }
        results[copy]["service"] = _through_service(
            url, f"{device}-{copy}", caches, copier, page_bytes=page_bytes, rounds=rounds
        )
        _say(f"speed ({copy}, {tokens} tokens, {total / 2**20:.0f} MiB): {results[copy]}")
    return results


def _through_service(
    url: str, name: str, caches: Any, copier: Copier, *, page_bytes: int, rounds: int
) -> dict[str, Any]:
    """A store and loads of the same request (a namespace per copy, `name`) through the
    worker half and the service."""
    layers = len(caches)
    count = (next(iter(caches.values())).shape[0] - 2) // 2
    device = next(iter(caches.values())).device.type
    layout = _layout(f"LBNHC-8b-{name}", device, layers=layers, block=16,
                     block_bytes=page_bytes * layers)  # fmt: skip
    source_ids = list(range(1, count + 1))
    target_ids = list(range(count + 1, 2 * count + 1))
    out: dict[str, list[float]] = {"save_call": [], "store": [], "load_http": [], "load_local": []}
    with ExitStack() as stack:
        pair = Pair(url, layout, stack)
        storing = pair.worker(caches, 2 * count + 2, copier)
        loaders = {
            local: pair.worker(caches, 2 * count + 2, copier, local_reads=local)
            for local in (False, True)
        }
        for index in range(rounds):
            tokens = pair.tokens(count, seed=5000 + index)
            _synchronize(device)
            started = time.perf_counter()
            storing.save(pair.store_plan(tokens, source_ids), skip=False)
            out["save_call"].append(time.perf_counter() - started)
            assert storing.wait_idle(300)
            out["store"].append(time.perf_counter() - started)
            for local, loader in loaders.items():
                plan = pair.load_plan(tokens, target_ids)
                fetched = fetch_requests(url)
                started = time.perf_counter()
                if loader.load(plan):
                    raise SystemExit("speed: a load through the service failed")
                _synchronize(device)
                out["load_local" if local else "load_http"].append(time.perf_counter() - started)
                if local and fetch_requests(url) != fetched:
                    raise SystemExit("speed: same-host reads came over HTTP")
    total = page_bytes * layers * count
    return {
        "save_call_ms": statistics.median(out["save_call"]) * 1e3,
        "store_gb_s": total / statistics.median(out["store"]) / 1e9,
        "load_http_gb_s": total / statistics.median(out["load_http"]) / 1e9,
        "load_local_reads_gb_s": total / statistics.median(out["load_local"]) / 1e9,
    }


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# Main --------------------------------------------------------------------------------------


def main() -> None:
    """Run the steps the device allows; print them and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    default_out = Path(os.environ.get("OUT", REPO / "bench" / "results")) / "cuda-check.json"
    parser.add_argument("--out", type=Path, default=default_out)
    args = parser.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
    _say(f"{report['device']} (torch {report['torch']})")
    with (
        tempfile.TemporaryDirectory(prefix="cuda-check-") as folder,
        our_service(
            Path(folder) / "data", local_reads="true", model_block_size=f"{MODEL}={SERVICE_BLOCK}"
        ) as service,
    ):
        report["bytes"] = check_bytes(service.url, device)
        if device == "cuda":
            report["order"] = check_order(service.url)
        else:
            report["order"] = "not run: needs CUDA"
            _say("order and host syncs: not run (they need CUDA)")
        report["speed"] = check_speed(service.url, device, args.tokens, args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    _say(f"wrote {args.out}")


if __name__ == "__main__":
    main()
