"""POST /v1/route against a real server: engines' holds from a real ZMQ publisher, the
payload store's own prefix, refusals as problem+json naming the field, and the client's
`route()` and `cache-service route` agreeing with the HTTP answer."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs
import pytest

from cache_service.client import AsyncCacheClient, CacheClient, InstanceHold, RouteAnswer
from cache_service.core.engines.schemes import scheme_named
from cache_service.tools.route_cli import add_route_parser, run_route_command
from tests.integration.conftest import ServerProcess
from tests.kv_events.following import BLOCK, SCHEME, SEED
from tests.kv_events.publisher import TestPublisher, stored

pytestmark = pytest.mark.integration

MODEL = "m"
PROMPT = list(range(5000, 5000 + 10 * BLOCK + 5))  # ten full blocks and five tokens
PROBLEM = "application/problem+json"


def route(server: ServerProcess, **body: Any) -> httpx.Response:
    """POST /v1/route with a JSON body."""
    return httpx.post(server.url + "/v1/route", json=body, timeout=10)


def published_hashes(tokens: list[int]) -> list[int]:
    """The block hashes vLLM publishes for `tokens` (sha256_cbor, PYTHONHASHSEED=0, block 16),
    in its default int form: the digest's last 8 bytes, big-endian."""
    digests = scheme_named(SCHEME, seed=SEED).block_hashes(tokens, block_size=BLOCK)
    return [int.from_bytes(digest, "big") & (2**64 - 1) for digest in digests]  # type: ignore[arg-type]


# -- without KV events: the payload store alone ------------------------------------------------


@pytest.fixture
def plain(make_server: Callable[..., ServerProcess]) -> ServerProcess:
    """A server following no engine, cutting prompts into blocks of BLOCK tokens."""
    return make_server(block_size=str(BLOCK))


def test_without_kv_events_no_instance_is_scored_and_the_store_answers(
    plain: ServerProcess,
) -> None:
    empty = route(plain, model=MODEL, tokens=PROMPT)
    assert empty.status_code == 200, empty.text
    assert empty.json() == {
        "model": MODEL,
        "prompt_tokens": len(PROMPT),
        "instances": [],
        "store": {
            "matched_blocks": 0,
            "cached_tokens": 0,
            "tokens_to_prefill": len(PROMPT),
            "block_size": BLOCK,
        },
        "best": None,
        "unscored": [],
    }
    with CacheClient(plain.url) as client:
        client.store(MODEL, PROMPT[: 4 * BLOCK], [b"kv"] * 4)
        answer = client.route(MODEL, PROMPT)
    assert answer.store.matched_blocks == 4
    assert answer.store.cached_tokens == 4 * BLOCK
    assert answer.store.tokens_to_prefill == len(PROMPT) - 4 * BLOCK
    assert answer.best == InstanceHold(
        None, "store", 4, 4 * BLOCK, len(PROMPT) - 4 * BLOCK, BLOCK, None, False
    )
    # Another namespace (salt) of the same tokens holds nothing.
    assert route(plain, model=MODEL, tokens=PROMPT, salt="x").json()["store"]["matched_blocks"] == 0


def test_a_routing_question_neither_counts_as_a_lookup_nor_refreshes(plain: ServerProcess) -> None:
    with CacheClient(plain.url) as client:
        client.store(MODEL, PROMPT[: 2 * BLOCK], [b"kv"] * 2)
        before = client.stats()["retention"]
        for _ in range(3):
            assert client.route(MODEL, PROMPT).store.matched_blocks == 2
        assert client.stats()["retention"] == before
        client.lookup(MODEL, PROMPT)  # by contrast, a lookup is counted
        assert client.stats()["retention"] != before


BAD_BODIES: list[tuple[str, dict[str, Any], int, str]] = [
    ("no model", {"tokens": [1]}, 422, "model"),
    ("string token", {"model": MODEL, "tokens": [1, "2"]}, 422, "tokens[1]"),
    ("negative token", {"model": MODEL, "tokens": [-1]}, 422, "tokens[0]"),
    ("token past 32 bits", {"model": MODEL, "tokens": [2**32]}, 422, "tokens[0]"),
    ("fractional token", {"model": MODEL, "tokens": [1.5]}, 422, "tokens[0]"),
    ("unknown field", {"model": MODEL, "tokens": [1], "prompt": "hi"}, 422, "prompt"),
    ("instances not a list", {"model": MODEL, "tokens": [1], "instances": "a"}, 422, "instances"),
    (
        "instance not a string",
        {"model": MODEL, "tokens": [1], "instances": [1]},
        422,
        "instances[0]",
    ),
    (
        "unknown instance",
        {"model": MODEL, "tokens": [1], "instances": ["gpu-7"]},
        422,
        "instances[0]",
    ),
    ("lora_name not a string", {"model": MODEL, "tokens": [1], "lora_name": 3}, 422, "lora_name"),
    ("block_size zero", {"model": MODEL, "tokens": [1], "block_size": 0}, 422, "block_size"),
    (
        "block_size not the model's",
        {"model": MODEL, "tokens": [1], "block_size": 64},
        422,
        "block_size",
    ),
    (
        "unknown retention",
        {"model": MODEL, "tokens": [1], "retention": "forever"},
        422,
        "retention",
    ),
]


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [row[1:] for row in BAD_BODIES],
    ids=[row[0] for row in BAD_BODIES],
)
def test_a_bad_body_is_a_problem_naming_the_field(
    plain: ServerProcess, body: dict[str, Any], status: int, field: str
) -> None:
    response = route(plain, **body)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    assert field in [error["field"] for error in response.json()["errors"]]


def test_a_body_that_is_not_json_or_not_an_object_is_a_400(plain: ServerProcess) -> None:
    for content in (b"{", b"[1, 2]"):
        response = httpx.post(
            plain.url + "/v1/route", content=content, headers={"content-type": "application/json"}
        )
        assert response.status_code == 400, response.text
        assert response.headers["content-type"] == PROBLEM
    text = httpx.post(
        plain.url + "/v1/route", content=b"1 2", headers={"content-type": "text/plain"}
    )
    assert text.status_code == 415


def test_the_schema_admits_exactly_the_bodies_the_route_accepts(plain: ServerProcess) -> None:
    document = httpx.get(plain.url + "/openapi.json").json()
    operation = document["paths"]["/v1/route"]["post"]
    schema = operation["requestBody"]["content"]["application/json"]["schema"]
    validator = jsonschema_rs.Draft202012Validator(schema)
    answer = operation["responses"]["200"]["content"]["application/json"]["schema"]
    assert answer == {"$ref": "#/components/schemas/RouteResponse"}
    # Bodies the schema can judge (the rest of BAD_BODIES depend on the configuration).
    config = {"unknown instance", "block_size not the model's", "unknown retention"}
    for name, body, _, _ in BAD_BODIES:
        assert validator.is_valid(body) == (name in config), name
    good = [
        {"model": MODEL, "tokens": PROMPT},
        {"model": MODEL, "tokens": [float(t) for t in PROMPT[:20]], "block_size": 16.0},
        {"model": MODEL, "tokens": [], "instances": [], "lora_name": None, "cache_salt": "s"},
    ]
    for body in good:
        assert validator.is_valid(body)
        assert route(plain, **body).status_code == 200


# -- with KV events from a real publisher ------------------------------------------------------


def publish_prefix(publisher: TestPublisher, tokens: list[int], blocks: int, **fields: Any) -> None:
    """The engine stores the first `blocks` blocks of `tokens` (one BlockStored)."""
    hashes = published_hashes(tokens)[:blocks]
    publisher.publish(
        [stored(hashes, token_ids=tokens[: blocks * BLOCK], block_size=BLOCK, **fields)]
    )


def wait_for(server: ServerProcess, check: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The route answer for PROMPT once `check` holds (the events arrive asynchronously)."""
    deadline = time.monotonic() + 10
    while True:
        answer = route(server, model=MODEL, tokens=PROMPT).json()
        if check(answer) or time.monotonic() > deadline:
            return answer
        time.sleep(0.05)


def rows(answer: dict[str, Any]) -> list[tuple[str, str, int, int, int]]:
    """(instance, medium, blocks, cached tokens, tokens to prefill) of each row, in order."""
    return [
        (
            r["instance"],
            r["medium"],
            r["matched_blocks"],
            r["cached_tokens"],
            r["tokens_to_prefill"],
        )
        for r in answer["instances"]
    ]


def test_the_engine_holding_the_longest_prefix_comes_first(
    following: ServerProcess, publishers: dict[str, TestPublisher]
) -> None:
    publish_prefix(publishers["a"], PROMPT, 7)
    publish_prefix(publishers["b"], PROMPT, 3)
    publish_prefix(publishers["b"], PROMPT, 3, medium="CPU")
    answer = wait_for(
        following, lambda a: len(a["instances"]) == 3 and a["instances"][-1]["matched_blocks"]
    )
    n = len(PROMPT)
    assert rows(answer) == [
        ("engine-a", "GPU", 7, 7 * BLOCK, n - 7 * BLOCK),
        ("engine-b", "GPU", 3, 3 * BLOCK, n - 3 * BLOCK),
        ("engine-b", "CPU", 3, 3 * BLOCK, n - 3 * BLOCK),
    ]
    assert answer["best"]["instance"] == "engine-a"
    assert answer["instances"][0]["data_parallel_rank"] == 0
    assert answer["instances"][0]["stale"] is False
    assert answer["unscored"] == []
    # Only the instances asked about; an unknown one is named.
    only_b = route(following, model=MODEL, tokens=PROMPT, instances=["engine-b"]).json()
    assert {row["instance"] for row in only_b["instances"]} == {"engine-b"}
    refused = route(following, model=MODEL, tokens=PROMPT, instances=["engine-b", "engine-z"])
    assert refused.status_code == 422
    assert refused.json()["type"].endswith("/unknown-instance")
    assert refused.json()["errors"][0]["field"] == "instances[1]"
    assert "engine-z" in refused.json()["detail"]
    # The store holds more than any engine: it is the best, "any worker can load these".
    with CacheClient(following.url) as client:
        client.store(MODEL, PROMPT[: 9 * BLOCK], [b"kv"] * 9)
    answer = route(following, model=MODEL, tokens=PROMPT).json()
    assert answer["store"]["matched_blocks"] == 9
    assert answer["best"]["instance"] is None and answer["best"]["medium"] == "store"
    assert answer["best"]["tokens_to_prefill"] == n - 9 * BLOCK


def test_a_cache_salt_is_hashed_as_vllm_does(
    following: ServerProcess, publishers: dict[str, TestPublisher]
) -> None:
    scheme = scheme_named(SCHEME, seed=SEED)
    digests = scheme.block_hashes(PROMPT, block_size=BLOCK, cache_salt="tenant-1")
    hashes = [int.from_bytes(d, "big") & (2**64 - 1) for d in digests]  # type: ignore[arg-type]
    publishers["a"].publish([stored(hashes, token_ids=PROMPT[: 10 * BLOCK], block_size=BLOCK)])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        salted = route(following, model=MODEL, tokens=PROMPT, cache_salt="tenant-1").json()
        if salted["best"]:
            break
        time.sleep(0.05)
    assert salted["best"]["instance"] == "engine-a"
    assert salted["best"]["matched_blocks"] == 10
    plain = route(following, model=MODEL, tokens=PROMPT).json()
    assert plain["best"] is None


def run_cli(url: str, prompt_file: Path, *extra: str) -> int:
    """`cache-service route ...` as the CLI runs it (the lead registers it in cli.py)."""
    parser = argparse.ArgumentParser(prog="cache-service")
    add_route_parser(parser.add_subparsers(dest="command", required=True))
    arguments = ["route", "--url", url, "--model", MODEL, "--prompt-file", str(prompt_file)]
    return run_route_command(parser.parse_args([*arguments, *extra]))


def test_the_client_and_the_cli_agree_with_the_http_answer(
    following: ServerProcess,
    publishers: dict[str, TestPublisher],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    publish_prefix(publishers["a"], PROMPT, 5)
    publish_prefix(publishers["b"], PROMPT, 8)
    wait_for(following, lambda a: a["best"] and a["best"]["matched_blocks"] == 8)
    with CacheClient(following.url) as client:
        client.store(MODEL, PROMPT[: 2 * BLOCK], [b"kv"] * 2)
        answer = client.route(MODEL, PROMPT)
    raw = route(following, model=MODEL, tokens=PROMPT).json()
    assert isinstance(answer, RouteAnswer)
    assert [(h.instance, h.matched_blocks) for h in answer.instances] == [
        ("engine-b", 8),
        ("engine-a", 5),
    ]
    assert answer.store.matched_blocks == raw["store"]["matched_blocks"] == 2
    assert answer.best is not None and answer.best.instance == "engine-b"

    async def ask() -> RouteAnswer:
        async with AsyncCacheClient(following.url) as twin:
            return await twin.route(MODEL, PROMPT)

    assert asyncio.run(ask()) == answer

    as_json = tmp_path / "prompt.json"
    as_json.write_text(json.dumps(PROMPT))
    as_words = tmp_path / "prompt.txt"
    as_words.write_text(
        "\n".join(" ".join(map(str, PROMPT[i : i + 10])) for i in range(0, len(PROMPT), 10))
    )
    capsys.readouterr()
    assert run_cli(following.url, as_json, "--json") == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["instances"] == [
        {key: getattr(hold, key) for key in printed["instances"][0]} for hold in answer.instances
    ]
    assert printed["store"]["matched_blocks"] == 2
    assert run_cli(following.url, as_words) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == f"model {MODEL}, {len(PROMPT)} prompt tokens"
    assert table[2].split()[:5] == [
        "engine-b",
        "GPU",
        "8",
        str(8 * BLOCK),
        str(len(PROMPT) - 8 * BLOCK),
    ]
    assert table[3].split()[0] == "engine-a"
    assert table[4].split()[:3] == ["(cache)", "store", "2"]
    assert table[-1].startswith("best: engine-b (GPU)")
    assert run_cli(following.url, as_json, "--instances", "engine-q") == 1
    assert "engine-q" in capsys.readouterr().err
    assert run_cli(following.url, tmp_path / "missing.json") == 2
