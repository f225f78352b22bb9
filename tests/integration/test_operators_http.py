"""Against a real server with keys: pin, unpin, pins, purge and explain, over HTTP and from
`cache-service admin`."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from cache_service.client import CacheClient
from tests.integration.conftest import ServerProcess, service_command

pytestmark = pytest.mark.integration

MakeServer = Callable[..., ServerProcess]
MODEL = "llama-3-8b"
PROMPT = list(range(7000, 7000 + 64 * 4))  # four blocks


@pytest.fixture
def service(make_server: MakeServer, keys: dict[str, str], tmp_path: Path) -> ServerProcess:
    """A server with two tenants, an operator, and a pin quota of six blocks."""
    del keys
    return make_server(auth="keys", api_keys_file=str(tmp_path / "keys.toml"), pin_quota_blocks="6")


def call(server: ServerProcess, key: str, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(server.url + path, json=body,
                      headers={"Authorization": f"Bearer {key}"}, timeout=30)  # fmt: skip


def test_pins_keep_to_their_tenant_and_its_quota(
    service: ServerProcess, keys: dict[str, str]
) -> None:
    with CacheClient(service.url, api_key=keys["a-writer"]) as a:
        a.put_prefix(MODEL, PROMPT, [b"kv"] * 4)
    pinned = call(service, keys["a-writer"], "/v1/pin", {"model": MODEL, "tokens": PROMPT})
    assert pinned.status_code == 200
    assert (pinned.json()["pinned_blocks"], pinned.json()["new"]) == (4, True)
    again = call(service, keys["a-writer"], "/v1/pin", {"model": MODEL, "tokens": PROMPT})
    assert again.json()["new"] is False
    # Three more blocks would pass the quota of six.
    with CacheClient(service.url, api_key=keys["a-writer"]) as a:
        a.put_prefix(MODEL, PROMPT[:64] + [1] * 192, [b"kv"] * 4)
    over = call(service, keys["a-writer"], "/v1/pin",
                {"model": MODEL, "tokens": PROMPT[:64] + [1] * 192})  # fmt: skip
    assert over.status_code == 403
    assert over.json()["limit"] == "pin_quota_blocks"
    # Tenant b sees no pin and cannot pin a's prefix (for b it is not stored).
    listed = httpx.get(service.url + "/v1/pins",
                       headers={"Authorization": f"Bearer {keys['b-writer']}"})  # fmt: skip
    assert listed.json() == {"tenant": "team-b", "pins": []}
    refused = call(service, keys["b-writer"], "/v1/pin", {"model": MODEL, "tokens": PROMPT})
    assert refused.status_code == 409
    assert refused.json()["type"].endswith("not-stored")
    named = call(service, keys["b-writer"], "/v1/pin",
                 {"model": MODEL, "tokens": PROMPT, "tenant": "team-a"})  # fmt: skip
    assert named.status_code == 403
    readers = call(service, keys["a-reader"], "/v1/pin", {"model": MODEL, "tokens": PROMPT})
    assert readers.status_code == 403
    mine = httpx.get(service.url + "/v1/pins",
                     headers={"Authorization": f"Bearer {keys['a-reader']}"}).json()  # fmt: skip
    assert [(p["blocks"], p["by"], p["model"]) for p in mine["pins"]] == [(4, "a-writer", MODEL)]
    released = call(service, keys["a-writer"], "/v1/unpin", {"model": MODEL, "tokens": PROMPT})
    assert released.json()["released_blocks"] == 4


def test_purge_is_admin_only_durable_and_explained(
    service: ServerProcess, keys: dict[str, str]
) -> None:
    with (
        CacheClient(service.url, api_key=keys["a-writer"]) as a,
        CacheClient(service.url, api_key=keys["b-writer"]) as b,
    ):
        a.put_prefix(MODEL, PROMPT, [b"a" * 100] * 4)
        b.put_prefix(MODEL, PROMPT, [b"b" * 100] * 4)
    assert call(service, keys["a-writer"], "/v1/purge", {}).status_code == 403
    purged = call(service, keys["ops"], "/v1/purge", {"tenant": "team-a"})
    assert purged.status_code == 200
    assert purged.json() == {"tenant": "team-a", "blocks": 4, "bytes": 400, "pins": 0}
    service.restart()  # durable: still gone after a restart
    with (
        CacheClient(service.url, api_key=keys["a-writer"]) as a,
        CacheClient(service.url, api_key=keys["b-writer"]) as b,
    ):
        assert a.lookup(MODEL, PROMPT).matched_blocks == 0
        assert b.lookup(MODEL, PROMPT).matched_blocks == 4  # the other tenant is untouched
    explained = call(service, keys["a-reader"], "/v1/explain", {"model": MODEL, "tokens": PROMPT})
    assert explained.status_code == 200
    assert explained.json()["reason"] == "purged"
    assert explained.json()["first_unmatched_block"] == 0


def test_explain_answers_within_a_tenant_only(service: ServerProcess, keys: dict[str, str]) -> None:
    with CacheClient(service.url, api_key=keys["a-writer"]) as a:
        a.put_prefix(MODEL, PROMPT, [b"kv"] * 4, salt="lora-7")
    own = call(service, keys["a-reader"], "/v1/explain", {"model": MODEL, "tokens": PROMPT})
    assert own.json()["reason"] == "never_stored"  # another salt's blocks are not a reader's
    admin = call(service, keys["ops"], "/v1/explain",
                 {"model": MODEL, "tokens": PROMPT, "tenant": "team-a"})  # fmt: skip
    assert admin.json()["reason"] == "other_namespace"
    assert admin.json()["facts"]["salt"] == "lora-7"  # only an admin looks across salts
    other = call(service, keys["b-writer"], "/v1/explain",
                 {"model": MODEL, "tokens": PROMPT, "salt": "lora-7"})  # fmt: skip
    assert other.json()["reason"] == "never_stored"  # b learns nothing of a's blocks
    complete = call(service, keys["a-reader"], "/v1/explain",
                    {"model": MODEL, "tokens": PROMPT, "salt": "lora-7"})  # fmt: skip
    assert (complete.json()["reason"], complete.json()["matched_blocks"]) == ("complete", 4)


def test_admin_cli_explains_and_purges(
    service: ServerProcess, keys: dict[str, str], tmp_path: Path
) -> None:
    with CacheClient(service.url, api_key=keys["a-writer"]) as a:
        a.put_prefix(MODEL, PROMPT, [b"kv"] * 4)
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(PROMPT[:128]))
    admin = [*service_command(), "admin"]
    common = ["--url", service.url, "--key", keys["ops"], "--tenant", "team-a"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*admin, *args], capture_output=True, text=True, timeout=60,
                              check=False)  # fmt: skip

    explained = run("explain", *common, "--model", MODEL, "--tokens", str(tokens))
    assert explained.returncode == 0, explained.stderr
    assert json.loads(explained.stdout)["reason"] == "complete"
    purged = run("purge", *common, "--model", MODEL, "--tokens", str(tokens))
    assert purged.returncode == 0, purged.stderr
    assert json.loads(purged.stdout)["blocks"] == 3  # block 1 and the two under it
    after = run("explain", *common, "--model", MODEL, "--tokens", str(tokens))
    assert json.loads(after.stdout)["reason"] == "purged"
    refused = run("purge", "--url", service.url, "--key", keys["a-writer"])
    assert refused.returncode == 1
    assert json.loads(refused.stdout)["status"] == 403


def test_every_explain_reason_a_real_server_can_reach(make_server: MakeServer) -> None:
    # (collision_rejected needs a crafted xxh3-128 collision: tests/test_operators.py stubs
    # the hash for it.)
    server = make_server(capacity="4MiB", retention="chat=7d,flash=1s",
                         touch_flush_interval="0.05")  # fmt: skip
    block = b"x" * 60 * 1024

    def why(tokens: list[int], **fields: object) -> dict[str, object]:
        answer = httpx.post(server.url + "/v1/explain",
                            json={"model": MODEL, "tokens": tokens, **fields})  # fmt: skip
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    with CacheClient(server.url) as client:
        client.put_prefix(MODEL, PROMPT[:128], [b"kv"] * 2)
        assert why(PROMPT[:128])["reason"] == "complete"
        assert why(PROMPT[:130])["reason"] == "partial_block"
        never = why(PROMPT)
        assert (never["reason"], never["first_unmatched_block"]) == ("never_stored", 2)
        assert why(PROMPT[:128], block_size=16)["reason"] == "block_size_differs"
        client.put_prefix(MODEL, [5] * 64, [b"kv"], retention="flash")
        time.sleep(1.2)
        expired = why([5] * 64)
        assert (expired["reason"], expired["facts"]["retention"]) == ("expired", "flash")
        client.put_prefix(MODEL, [6] * 64, [block])
        for label in range(100, 200):  # 6 MiB through a 4 MiB cache
            client.put_prefix(MODEL, [label] * 64, [block])
        evicted = why([6] * 64)
        assert (evicted["reason"], evicted["facts"]["cause"]) == ("evicted", "capacity")


def test_a_pinned_prefix_survives_an_eviction_storm(make_server: MakeServer) -> None:
    server = make_server(capacity="4MiB")
    block = b"x" * 60 * 1024
    with CacheClient(server.url) as client:
        client.put_prefix(MODEL, PROMPT, [block] * 4)
        pinned = httpx.post(server.url + "/v1/pin", json={"model": MODEL, "tokens": PROMPT})
        assert pinned.json()["pinned_blocks"] == 4
        for label in range(100, 300):  # 12 MiB through a 4 MiB cache
            client.put_prefix(MODEL, [label] * 64, [block])
        assert client.lookup(MODEL, PROMPT).matched_blocks == 4
        assert client.lookup(MODEL, [100] * 64).matched_blocks == 0  # the storm did evict


def test_every_worker_process_explains_from_the_same_removal_log(
    make_server: MakeServer,
) -> None:
    server = make_server(capacity="4MiB", workers="2")
    block = b"x" * 60 * 1024
    with CacheClient(server.url) as client:
        client.put_prefix(MODEL, [6] * 64, [block])
        for label in range(100, 200):  # evictions happen in whichever worker stored
            client.put_prefix(MODEL, [label] * 64, [block])
    reasons = set()
    for _ in range(12):  # a fresh connection each time: both workers answer some
        with httpx.Client() as fresh:
            answer = fresh.post(server.url + "/v1/explain",
                                json={"model": MODEL, "tokens": [6] * 64})  # fmt: skip
            reasons.add(answer.json()["reason"])
    assert reasons == {"evicted"}
