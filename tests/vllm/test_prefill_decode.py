"""Prefill and decode on separate vLLM engines, through the service, behind `pd-proxy`.

One scenario, run once (module fixture `run`), each test asserting one part of it. The guide's
commands (docs/content/guides/prefill-decode.md, the blocks whose marker names this file) are
run as a reader pastes them, in a folder laid out as the guide's clone (`.venv`, `.venv-vllm`
and `out/smollm2-hf` are the ones the other tests use), the ports made free ones: the service,
the prefill engine P (kv_both) and the decode engine D1 (kv_consumer, asynchronous loads),
SmolLM2 in float32 with blocks of 128, and `cache-service pd-proxy` in front of them. Beside
them the test's own D2 (kv_consumer, vLLM's dev mode), started side by side:

    P   loads what the service holds, computes the rest, stores it, and answers a prefill
        request (`do_remote_decode`) with what it stored
    D1  behind the proxy: loads all P stored, the partial last block too, and computes only
        the last token again
    D2  the references, computing every token (its prefix cache emptied after them); then,
        asked directly, a prompt sharing a prefix P stored loads it, with no prefill anywhere

Then the faults, each in the middle of a request through the proxy: the service killed (P
and D compute what they must; the answer is the reference's), P killed (D computes the whole
prompt; the reference's answer), D1 killed (a 502 or 503 problem at once, never a hang).

An engine that starts from loaded KV computes the rest of a prompt in other shapes than one that
computes it all, so outputs are compared as the other connector tests compare them
(tests/vllm/greedy.py): the same tokens, or parted only at a near-tie, every parting reported.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.vllm_server import SERVED_NAME, VllmServer, metric
from tests.docs_site.code_blocks import find_blocks
from tests.integration.conftest import free_port
from tests.vllm.conftest import REPO
from tests.vllm.greedy import TOP, partings
from tests.vllm.guide_runner import (
    kill_tree,
    lay_out_clone,
    service_env,
    start_script,
    stop_group,
)

GUIDE = REPO / "docs" / "content" / "guides" / "prefill-decode.md"
THIS = "tests/vllm/test_prefill_decode.py"  # what a block's marker names when this test runs it
ENGINE_BLOCK = 128
PROMPT_TOKENS = (1_100, 2_100)  # 8 and 16 whole blocks, and 76 and 52 tokens more
SHARED_PREFIX = 1_024  # D2's prompt: the first prompt's first 8 blocks, then its own tokens
NEW_TOKENS = 8
FAULT_TOKENS = 1_000  # P prefills it for seconds: long enough to be killed in the middle
ASYNC = {"load_mode": "async"}  # the only loads that take a whole prompt


def _prompts() -> list[list[int]]:
    rng = random.Random(44)
    return [[rng.randrange(1_000, 40_000) for _ in range(n)] for n in PROMPT_TOKENS]


def _d2_prompt(first: list[int]) -> list[int]:
    rng = random.Random(4402)
    return first[:SHARED_PREFIX] + [rng.randrange(1_000, 40_000) for _ in range(150)]


def completion(url: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    """A greedy completion of `prompt` with its top logprobs, tokens as ids."""
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "logprobs": TOP,
        "return_tokens_as_token_ids": True,
        **extra,
    }
    answer = httpx.post(url + "/v1/completions", json=body, timeout=600)
    answer.raise_for_status()
    result: dict[str, Any] = answer.json()
    return result


def as_output(answer: dict[str, Any]) -> dict[str, Any]:
    """A completion's tokens, top logprobs and cached tokens, in tests/vllm/greedy.py's shape."""
    logprobs = answer["choices"][0]["logprobs"]
    details = answer["usage"].get("prompt_tokens_details") or {}
    return {
        "tokens": [int(name.removeprefix("token_id:")) for name in logprobs["tokens"]],
        "top": [
            {name.removeprefix("token_id:"): value for name, value in position.items()}
            for position in logprobs["top_logprobs"]
        ],
        "text": answer["choices"][0]["text"],
        "cached_tokens": details.get("cached_tokens", 0),
    }


def streamed_text(url: str, prompt: list[int]) -> str:
    """The text of a streamed greedy completion, its chunks joined."""
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    text = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.extend(choice["text"] for choice in json.loads(line[6:])["choices"])
    return "".join(text)


def guide_script(ports: dict[int, int]) -> str:
    """The guide's blocks this test runs, joined, with its ports replaced by `ports`."""
    blocks = find_blocks(GUIDE.read_text(encoding="utf-8"), GUIDE.relative_to(REPO))
    runs = [b for b in blocks if b.language == "sh" and b.marker and THIS in b.marker.reason]
    assert len(runs) == 3, f"{GUIDE}: the blocks naming {THIS} changed: update this test"
    script = "".join(block.text for block in runs)
    for written, port in ports.items():
        assert f"127.0.0.1:{written}" in script, f"the guide no longer says port {written}"
        script = script.replace(f"127.0.0.1:{written}", f"127.0.0.1:{port}")
        script = script.replace(f" {written} ", f" {port} ").replace(
            f"--port {written}", f"--port {port}"
        )
    return script


class Started:
    """The processes the guide's script left running, by the PIDs it wrote."""

    def __init__(self, folder: Path, ports: dict[int, int]) -> None:
        out = folder / "out"
        self.service_pid = int((out / "pd-service.pid").read_text())
        self.p_pid = int((out / "prefill.log.pid").read_text())
        self.d1_pid = int((out / "decode.log.pid").read_text())
        self.service = f"http://127.0.0.1:{ports[8080]}"
        self.p = f"http://127.0.0.1:{ports[8100]}"
        self.d1 = f"http://127.0.0.1:{ports[8200]}"
        self.proxy = f"http://127.0.0.1:{ports[8300]}"


@pytest.fixture(scope="module")
def run(smollm2_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The scenario, once; what each step saw."""
    folder = tmp_path_factory.mktemp("prefill-decode")
    lay_out_clone(folder, smollm2_folder)
    ports = {written: free_port() for written in (8080, 8100, 8200, 8300)}
    # D2, the test's own (vLLM's dev mode: its prefix cache emptied after the references)
    d2 = VllmServer(smollm2_folder, f"http://127.0.0.1:{ports[8080]}", "kv_consumer",
                    folder / "D2.log", extra=ASYNC)  # fmt: skip
    output = folder / "guide-output.txt"
    leader = start_script(guide_script(ports), folder, service_env(ports[8080]), output)
    try:
        code = leader.wait(600)
        assert code == 0, output.read_text(errors="replace")[-4000:]
        d2.wait_ready()
        started = Started(folder, ports)
        yield _scenario(started, d2)
    finally:
        stop_group(leader)
        d2.stop()


def _scenario(started: Started, d2: VllmServer) -> dict[str, Any]:
    """The requests, the counts, then the faults."""
    prompts = _prompts()
    off = {"prompt_cache": {"load": False, "store": False}}
    # References from D2 computing every token (then its prefix cache emptied)
    seen: dict[str, Any] = {
        "reference": [as_output(completion(d2.url, x, kv_transfer_params=off)) for x in prompts],
        "d2_reference": as_output(
            completion(d2.url, _d2_prompt(prompts[0]), kv_transfer_params=off)
        ),
    }
    faults = _fault_prompts()
    began = time.monotonic()
    seen["fault_reference"] = [as_output(completion(d2.url, faults[0], kv_transfer_params=off))]
    mid = (time.monotonic() - began) / 3  # a third of a whole prompt's compute: mid-prefill
    seen["fault_reference"].append(as_output(completion(d2.url, faults[1], kv_transfer_params=off)))
    d2.reset_prefix_cache()
    p, d1 = started.p, started.d1
    p_before = metric(p, "vllm:request_success_total")
    seen["decoded"] = [as_output(completion(started.proxy, x)) for x in prompts]
    seen["p_requests"] = metric(p, "vllm:request_success_total") - p_before
    connector = "vllm:prompt_cache_connector_"
    seen["d1"] = {
        "hit_tokens": metric(d1, connector + "hit_tokens_total"),
        "not_stored": metric(d1, connector + "misses_total", 'reason="prefill_not_stored"'),
        "computed": metric(d1, "vllm:prompt_tokens_by_source_total", 'source="local_compute"'),
        "loaded": metric(d1, "vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"'),
        "waits": metric(d1, connector + "prefill_waits_total"),
        "stored_blocks": metric(d1, connector + "stored_blocks_total"),
    }
    seen["service_blocks"] = httpx.get(started.service + "/v1/stats", timeout=30).json()["blocks"]
    seen["streamed"] = streamed_text(started.proxy, prompts[0])
    seen["proxy_metrics"] = httpx.get(started.proxy + "/metrics", timeout=30).text
    p_before = metric(p, "vllm:request_success_total")
    seen["d2"] = as_output(completion(d2.url, _d2_prompt(prompts[0])))
    seen["d2_p_requests"] = metric(p, "vllm:request_success_total") - p_before
    seen.update(_faults(started, faults, mid))
    counts = {k: v for k, v in seen.items() if not k.startswith(("proxy_metrics", "fault_r"))}
    print(json.dumps(counts, default=str)[:4000])  # shown with a failure
    return seen


def _fault_prompts() -> list[list[int]]:
    rng = random.Random(4403)
    return [[rng.randrange(1_000, 40_000) for _ in range(FAULT_TOKENS)] for _ in range(3)]


def _while_killing(
    send: Callable[[], httpx.Response], after_seconds: float, pid: int
) -> tuple[httpx.Response, float]:
    """`send` on a thread; SIGKILL to `pid` and what it started `after_seconds` later (an
    engine reports a request running only once a step ended, too late to find one
    mid-prefill); the answer and its seconds after the kill."""
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(send)
        time.sleep(after_seconds)
        assert not answer.done(), "the request ended before the kill: make its prompt longer"
        kill_tree(pid)
        killed = time.monotonic()
        response = answer.result(timeout=600)
    return response, time.monotonic() - killed


def _faults(started: Started, faults: list[list[int]], mid: float) -> dict[str, Any]:
    """The service, then P, then D1 killed in the middle of a request through the proxy."""

    def send(prompt: list[int], max_tokens: int = NEW_TOKENS) -> Callable[[], httpx.Response]:
        body = {
            "model": SERVED_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": TOP,
            "return_tokens_as_token_ids": True,
        }
        return lambda: httpx.post(started.proxy + "/v1/completions", json=body, timeout=600)

    seen: dict[str, Any] = {}
    answer, seen["service_killed_seconds"] = _while_killing(
        send(faults[0]), mid, started.service_pid
    )
    seen["service_killed"] = (answer.status_code, as_output(answer.json()))
    answer, seen["p_killed_seconds"] = _while_killing(send(faults[1]), mid, started.p_pid)
    seen["p_killed"] = (answer.status_code, as_output(answer.json()))
    answer, seen["d_killed_seconds"] = _while_killing(send(faults[2], 400), mid, started.d1_pid)
    seen["d_killed"] = (
        answer.status_code,
        answer.headers.get("content-type", ""),
        answer.json(),
    )
    seen["proxy_metrics_after_faults"] = httpx.get(started.proxy + "/metrics", timeout=30).text
    return seen


def test_decode_gives_the_tokens_one_engine_gives(run: dict[str, Any]) -> None:
    parted = partings(run["decoded"], run["reference"])
    assert len(parted) <= 1, parted  # a near-tie may part one prompt, never every prompt


def test_decode_loads_the_whole_prompt_and_computes_only_its_last_token(
    run: dict[str, Any],
) -> None:
    # Every whole block under the prompt's keys, the partial last one under the request's own
    # (handoff.py); vLLM computes the last token again, for its logits. (The answers' own
    # cached_tokens are the prefill engine's hits, by vLLM's P/D convention: 0 here.)
    assert run["d1"]["hit_tokens"] == sum(PROMPT_TOKENS)
    # vLLM counts every prompt token as loaded, the last one it computes again included
    assert run["d1"]["loaded"] == sum(PROMPT_TOKENS)
    assert run["d1"]["computed"] <= len(PROMPT_TOKENS)
    # The service's blocks of 64 tokens, two a group of 128: every whole group, and the last
    assert run["service_blocks"] == sum(2 * (n // ENGINE_BLOCK) + 2 for n in PROMPT_TOKENS)
    assert run["d1"]["stored_blocks"] == 0  # a consumer stores nothing


def test_each_request_is_prefilled_once_and_decode_never_loads_early(run: dict[str, Any]) -> None:
    assert run["p_requests"] == len(PROMPT_TOKENS)
    assert run["d1"]["not_stored"] == 0  # no wait for P's stores ran out


def test_a_streamed_answer_through_the_proxy_carries_the_same_text(run: dict[str, Any]) -> None:
    assert run["streamed"] == run["decoded"][0]["text"]


def test_another_decode_engine_loads_a_shared_prefix_with_no_prefill(run: dict[str, Any]) -> None:
    assert run["d2"]["cached_tokens"] == SHARED_PREFIX
    assert run["d2_p_requests"] == 0
    parted = partings([run["d2"]], [run["d2_reference"]])
    assert not parted or len(parted) == 1, parted


def test_the_proxy_counts_requests_and_prefill_times(run: dict[str, Any]) -> None:
    assert "prompt_cache_pd_proxy_requests_total" in run["proxy_metrics"]
    assert "prompt_cache_pd_proxy_prefill_seconds" in run["proxy_metrics"]


def test_the_service_killed_mid_request_costs_speed_not_the_answer(run: dict[str, Any]) -> None:
    status, output = run["service_killed"]
    assert status == 200
    parted = partings([output], run["fault_reference"][:1])
    assert not parted, parted  # both computed the whole prompt in the same shapes


def test_the_prefill_engine_killed_mid_request_leaves_decode_to_compute_it(
    run: dict[str, Any],
) -> None:
    status, output = run["p_killed"]
    assert status == 200
    parted = partings([output], run["fault_reference"][1:2])
    assert not parted, parted
    assert 'reason="prefill_error"' in run["proxy_metrics_after_faults"]


def test_the_decode_engine_killed_mid_request_is_a_clear_error_at_once(
    run: dict[str, Any],
) -> None:
    status, content_type, problem = run["d_killed"]
    assert status in (502, 503), problem
    assert content_type.startswith("application/problem+json")
    assert problem["status"] == status and problem["detail"]
    assert run["d_killed_seconds"] < 30
