"""Blocks that do not fit the running model are refused and counted, never used; a cache that
is down, or goes down, makes the worker compute everything, never fail."""

from __future__ import annotations

import dataclasses
import http.server
import struct
import threading

import httpx
import pytest
import torch

from cache_service.client import CacheClient
from cache_service.integrations import worker as worker_module
from cache_service.integrations.kv_codec import encode_block
from cache_service.integrations.kv_layout import KVLayout
from cache_service.integrations.model import CausalLM, tiny_model
from cache_service.integrations.worker import PrefillWorker
from tests.integration.conftest import ServerProcess, free_port

PROMPT = list(range(3, 203))  # 200 tokens: three full blocks of 64


def foreign_block(layout: KVLayout) -> bytes:
    """A payload written for `layout`: its header and KV tensors of its shape and dtype."""
    shape = (layout.kv_heads, layout.block_size, layout.head_size)
    dtype = getattr(torch, layout.dtype)
    return encode_block(
        layout, [(torch.ones(shape, dtype=dtype), torch.ones(shape, dtype=dtype))] * layout.layers
    )


@pytest.mark.parametrize(
    "change",
    [
        {"model": "another-model"},
        {"digest": "sha256:" + "00" * 32},
        {"layers": 3},
        {"kv_heads": 1},
        {"head_size": 8},
        {"dtype": "float16"},
        {"block_size": 32},
    ],
    ids=lambda change: next(iter(change)),
)
def test_a_block_of_another_layout_under_the_namespace_is_refused_and_counted(
    change: dict[str, object], tiny: CausalLM, cache_server: ServerProcess
) -> None:
    """A writer that named its namespace wrongly put block 1 of another layout there: the
    worker uses block 0, refuses block 1 (and so block 2 after it), and computes the rest."""
    with CacheClient(cache_server.url) as client:
        worker = PrefillWorker(tiny, client)
        layout = worker.layout
        good = worker.prefill(PROMPT[:64])  # block 0, the worker's own
        assert good.stored_blocks == 1
        bad = foreign_block(dataclasses.replace(layout, **change))  # type: ignore[arg-type]
        honest = PrefillWorker(tiny, client, store=False).prefill(PROMPT)  # block 2's bytes
        block_2 = encode_block(layout, tiny.kv_range(honest.cache, 128, 192))
        stored = client.store(
            tiny.name,
            PROMPT[:192],
            [bad, block_2],
            kv_layout=layout.namespace_name,
            start_block=1,
            block_size=64,
        )
        assert stored.stored_blocks == 2
        prefill = worker.prefill(PROMPT)
    field = next(iter(change))
    assert worker.refused == {field: 1}
    assert (prefill.cached_tokens, prefill.refused_blocks) == (64, 2)
    logits, _ = tiny.forward(PROMPT)
    assert float((prefill.logits - logits).abs().max()) <= 1e-5 * (1 + float(logits.abs().max()))


def test_another_model_never_finds_the_blocks_of_this_one(
    tiny: CausalLM, cache_server: ServerProcess
) -> None:
    """Its layout is in the namespace: other weights (another seed) look up other keys."""
    other = tiny_model(seed=1)
    with CacheClient(cache_server.url) as client:
        assert PrefillWorker(tiny, client).prefill(PROMPT).stored_blocks == 3
        renamed = CausalLM(other.model, name=tiny.name, digest=other.digest)
        worker = PrefillWorker(renamed, client)
        prefill = worker.prefill(PROMPT)
    assert prefill.cached_tokens == 0 and not worker.refused
    assert prefill.stored_blocks == 3  # its own blocks, beside the first model's


def test_a_cache_that_is_down_makes_the_worker_compute_everything(tiny: CausalLM) -> None:
    with CacheClient(f"http://127.0.0.1:{free_port()}", timeout=1.0) as client:
        worker = PrefillWorker(tiny, client)
        prefill, continuation = worker.generate(PROMPT, 8)
    logits, cache = tiny.forward(PROMPT)
    assert (prefill.cached_tokens, prefill.stored_blocks) == (0, 0)
    assert torch.equal(prefill.logits, logits)
    assert continuation == tiny.greedy(logits, cache, 8)
    assert worker.layout.block_size == 64  # the default, with no service to ask
    assert worker.cache_errors == {"info 503": 1, "lookup 503": 1, "store 503": 1}


def test_a_cache_that_goes_down_between_turns_is_survived(
    tiny: CausalLM, cache_server: ServerProcess
) -> None:
    with CacheClient(cache_server.url, timeout=1.0, fail_open=True) as client:
        worker = PrefillWorker(tiny, client)
        assert worker.prefill(PROMPT[:150]).stored_blocks == 2
        cache_server.stop()
        prefill, continuation = worker.generate(PROMPT, 8)
        assert client.failures.total >= 1  # fail-open misses, counted by the client
    logits, cache = tiny.forward(PROMPT)
    assert prefill.cached_tokens == 0
    assert torch.equal(prefill.logits, logits)
    assert continuation == tiny.greedy(logits, cache, 8)


def test_a_long_prompt_is_stored_in_several_requests(
    tiny: CausalLM, cache_server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests stay under STORE_REQUEST_BYTES: here one block each, chained by start_block."""
    monkeypatch.setattr(worker_module, "STORE_REQUEST_BYTES", 1)
    prompt = list(range(1, 330))  # five full blocks
    with CacheClient(cache_server.url) as client:
        sent: list[int] = []
        store = client.store

        def count_then_store(*args: object, **kwargs: object) -> object:
            sent.append(len(args[2]))  # type: ignore[arg-type]
            return store(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(client, "store", count_then_store)
        worker = PrefillWorker(tiny, client)
        assert worker.prefill(prompt).stored_blocks == 5
        assert sent == [1, 1, 1, 1, 1]
        assert worker.prefill(prompt).cached_tokens == 320


def test_a_prefix_evicted_between_lookup_and_store_is_stored_again(
    tiny: CausalLM, cache_server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The namespace is purged while the worker computes the rest (its lookup had hit): the
    store of the new blocks finds no parent (409), and the worker stores the prompt whole."""
    with CacheClient(cache_server.url) as client:
        worker = PrefillWorker(tiny, client)
        assert worker.prefill(PROMPT[:128]).stored_blocks == 2
        compute = tiny.forward

        def purge_then_compute(*args: object, **kwargs: object) -> object:
            answer = httpx.post(
                cache_server.url + "/v1/purge",
                json={"model": tiny.name, "kv_layout": worker.layout.namespace_name},
            )
            assert answer.status_code == 200 and answer.json()["blocks"] == 2
            return compute(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(tiny, "forward", purge_then_compute)
        prefill = worker.prefill(PROMPT)
        monkeypatch.undo()
        assert (prefill.cached_tokens, prefill.stored_blocks) == (128, 3)
        assert not worker.cache_errors
        assert worker.prefill(PROMPT).cached_tokens == 192


def test_a_payload_that_is_not_a_block_is_refused_and_the_prefill_goes_on(
    tiny: CausalLM, cache_server: ServerProcess
) -> None:
    text = b"[" * 60000  # JSON nested deeper than Python's parser goes
    junk = struct.pack("<4sHH", b"PCKV", 1, len(text)) + text
    with CacheClient(cache_server.url) as client:
        worker = PrefillWorker(tiny, client)
        assert worker.prefill(PROMPT[:64]).stored_blocks == 1
        layout = worker.layout
        client.store(
            tiny.name, PROMPT[:128], [junk], kv_layout=layout.namespace_name, start_block=1
        )
        prefill = worker.prefill(PROMPT)
    assert worker.refused == {"format": 1}
    assert (prefill.cached_tokens, prefill.refused_blocks, prefill.stored_blocks) == (64, 1, 1)
    logits, _ = tiny.forward(PROMPT)
    assert float((prefill.logits - logits).abs().max()) <= 1e-5 * (1 + float(logits.abs().max()))


def test_a_server_that_is_not_the_cache_leaves_the_worker_on_its_defaults(
    tiny: CausalLM,
) -> None:
    """Something else on the port answers 200 with JSON of another shape."""

    class OtherService(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"{}"
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), OtherService)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with CacheClient(url, timeout=2.0) as client:
            worker = PrefillWorker(tiny, client)
            prefill = worker.prefill(PROMPT)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert worker.layout.block_size == 64
    assert worker.cache_errors["info invalid"] == 1
    assert prefill.cached_tokens == 0
