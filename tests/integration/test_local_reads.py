"""Same-host reads against a real service: the payloads come from the store's files, equal to
what HTTP serves; a folder that is not the service's, or a damaged payload, never makes the
client answer with bytes the service would not vouch for; without --local-reads the client
says why and fetches over HTTP, and asks again later; a store whose files no other process
reads refuses the flag."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import httpx
import lmdb
import pytest

from bench.services import fetch_requests
from cache_service.client import CacheClient, sync
from cache_service.client.local_reads import (
    RETRY_SECONDS,
    LocalReads,
    LocalReadsSetup,
    LocalReadsUnavailable,
)
from cache_service.core.errors import ServiceError, StorageError
from cache_service.core.store.lmdb.reader import LmdbReader
from cache_service.wire.answers import LocalReadsResponse
from tests.integration.conftest import ServerProcess

pytestmark = pytest.mark.integration

MODEL = "local-reads-model"
BLOCK = 16
PROMPT = list(range(1000, 1000 + 8 * BLOCK))  # 8 blocks
BLOCKS = [os.urandom(3000) for _ in range(8)]


def lookups_served(server: ServerProcess) -> float:
    """How many POST /v1/lookup the service has answered with 200."""
    text = httpx.get(server.url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("prompt_cache_requests_total")
        and '"/v1/lookup"' in line
        and 'code="200"' in line
    )


@pytest.fixture
def local_server(make_server: Callable[..., ServerProcess]) -> ServerProcess:
    """A service offering same-host reads, holding the prompt's 8 blocks."""
    server = make_server(local_reads="true", model_block_size=f"{MODEL}={BLOCK}")
    with CacheClient(server.url) as writer:
        assert writer.put_prefix(MODEL, PROMPT, BLOCKS) == len(BLOCKS)
    return server


def test_a_same_host_client_reads_the_payloads_from_the_files(local_server: ServerProcess) -> None:
    with CacheClient(local_server.url, local_reads=True) as client:
        assert client.local_reads_status == "not asked yet"
        match = client.lookup(MODEL, [*PROMPT, 7, 7, 7], fetch=True)
        assert client.local_reads_status == f"on: {local_server.data_dir.resolve()}"
    assert match.matched_blocks == 8 and match.cached_tokens == 8 * BLOCK
    assert match.payloads == BLOCKS
    assert fetch_requests(local_server.url) == 0  # not one payload came over HTTP
    assert lookups_served(local_server) == 1  # the lookup itself did, and was counted
    with CacheClient(local_server.url) as plain:  # the same answer as over HTTP
        over_http = plain.lookup(MODEL, [*PROMPT, 7, 7, 7], fetch=True)
    assert over_http.keys == match.keys and over_http.payloads == match.payloads


def test_a_prefix_of_the_stored_prompt_reads_only_its_blocks(local_server: ServerProcess) -> None:
    with CacheClient(local_server.url, local_reads=True) as client:
        match = client.lookup(MODEL, PROMPT[: 3 * BLOCK + 5], fetch=True)
        other = client.lookup(MODEL, PROMPT[:BLOCK] + [1] * BLOCK, fetch=True)
    assert match.matched_blocks == 3 and match.payloads == BLOCKS[:3]
    assert other.matched_blocks == 1 and other.payloads == BLOCKS[:1]


def test_blocks_asked_for_by_key_come_from_the_files_and_the_rest_over_http(
    local_server: ServerProcess,
) -> None:
    with CacheClient(local_server.url) as plain:
        keys = list(plain.lookup(MODEL, PROMPT).keys)
    unknown = "ab" * 16  # a key no store holds: the files lack it, so HTTP is asked
    seen: dict[int, bytes | None] = {}
    with CacheClient(local_server.url, local_reads=True) as client:
        got = client.get_blocks(MODEL, [*keys, unknown])
        assert client.local_reads_status.startswith("on: ")
        client.read_blocks(
            MODEL, keys[::-1], lambda i, view: seen.__setitem__(i, view and bytes(view))
        )
        foreign = client.get_blocks("another-model", keys[:2])
    assert got == [*BLOCKS, None]
    assert seen == {index: BLOCKS[7 - index] for index in range(8)}
    assert foreign == [None, None]  # another namespace's keys: neither the files nor HTTP
    assert fetch_requests(local_server.url) == 2  # the unknown key, then the foreign pair


def test_a_damaged_payload_asked_for_by_key_is_none(local_server: ServerProcess) -> None:
    with CacheClient(local_server.url) as plain:
        keys = list(plain.lookup(MODEL, PROMPT).keys)
    data = local_server.data_dir / "data.mdb"
    raw = bytearray(data.read_bytes())
    at = raw.find(BLOCKS[2][:64])
    with data.open("r+b") as file:  # bit rot under the running service, in its mapped file
        file.seek(at + 100)
        file.write(bytes([raw[at + 100] ^ 0x01]))
    with CacheClient(local_server.url, local_reads=True) as client:
        got = client.get_blocks(MODEL, keys)
    # The files fail block 2's checksum, so does the service (asked for it alone).
    assert got == [*BLOCKS[:2], None, *BLOCKS[3:]]
    assert fetch_requests(local_server.url) == 1


def test_a_folder_that_is_not_the_services_is_never_trusted(
    make_server: Callable[..., ServerProcess], local_server: ServerProcess
) -> None:
    # Another service's store with the same seed, holding other bytes for the same prompt:
    # its blocks would verify, but its store id is not the one the service named.
    other = make_server(model_block_size=f"{MODEL}={BLOCK}")
    with CacheClient(other.url) as writer:
        writer.put_prefix(MODEL, PROMPT, [b"x" * 3000] * 8)
    other.stop()
    with CacheClient(local_server.url, local_reads=True, local_reads_path=other.data_dir) as client:
        match = client.lookup(MODEL, PROMPT, fetch=True)
        status = client.local_reads_status
    assert status.startswith("unavailable: ") and "not the service's" in status
    assert match.payloads == BLOCKS  # the service's own blocks, over HTTP


def test_files_that_fail_to_read_leave_the_payloads_to_http_in_bounded_fetches(
    local_server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unreadable(*_args: object, **_kwargs: object) -> None:
        raise lmdb.ReadonlyError("the files failed")

    monkeypatch.setattr(LmdbReader, "read_prefix", unreadable)
    monkeypatch.setattr(sync, "FETCH_KEYS", 3)  # 8 blocks: fetches of 3, 3 and 2 keys
    before = fetch_requests(local_server.url)
    with CacheClient(local_server.url, local_reads=True) as client:
        match = client.lookup(MODEL, PROMPT, fetch=True)
        assert client.local_reads_status.startswith("on: ")
    assert match.matched_blocks == 8 and match.payloads == BLOCKS
    assert fetch_requests(local_server.url) == before + 3


def test_an_offer_that_could_not_be_used_is_asked_for_again_later(
    local_server: ServerProcess,
) -> None:
    offer = LocalReadsResponse(**httpx.get(local_server.url + "/v1/local-reads").json())
    now, asked = [0.0], []

    def ask() -> LocalReadsResponse:
        asked.append(now[0])
        if len(asked) == 1:
            raise StorageError("the service was restarting")
        return offer

    setup = LocalReadsSetup(True, None, clock=lambda: now[0])
    assert setup.reader(ask) is None and setup.status.startswith("unavailable: ")
    now[0] = RETRY_SECONDS / 2
    assert setup.reader(ask) is None and asked == [0.0]  # not asked again yet
    now[0] = RETRY_SECONDS
    assert setup.reader(ask) is not None and setup.status.startswith("on: ")
    assert asked == [0.0, RETRY_SECONDS]
    setup.close()
    assert setup.status == "closed" and setup.reader(ask) is None


def test_a_damaged_payload_ends_the_match_before_it(local_server: ServerProcess) -> None:
    data = local_server.data_dir / "data.mdb"
    raw = bytearray(data.read_bytes())
    at = raw.find(BLOCKS[5][:64])
    assert at >= 0 and raw.find(BLOCKS[5][:64], at + 1) < 0
    with data.open("r+b") as file:  # bit rot under the running service, in its mapped file
        file.seek(at + 100)
        file.write(bytes([raw[at + 100] ^ 0x01]))
    with CacheClient(local_server.url, local_reads=True) as client:
        match = client.lookup(MODEL, PROMPT, fetch=True)
    # The files fail block 5's checksum, so does the service: the match is its first 5 blocks.
    assert match.matched_blocks == 5 and match.cached_tokens == 5 * BLOCK
    assert match.payloads == BLOCKS[:5]
    assert match.usage.prompt_cache_miss_tokens == 3 * BLOCK


def test_without_the_flag_the_client_says_why_and_fetches_over_http(
    make_server: Callable[..., ServerProcess],
) -> None:
    server = make_server(model_block_size=f"{MODEL}={BLOCK}")
    answer = httpx.get(server.url + "/v1/local-reads")
    assert answer.status_code == 404
    assert answer.headers["content-type"] == "application/problem+json"
    assert "--local-reads" in answer.json()["detail"]
    with CacheClient(server.url, local_reads=True) as client:
        client.put_prefix(MODEL, PROMPT, BLOCKS)
        match = client.lookup(MODEL, PROMPT, fetch=True)
        assert client.local_reads_status.startswith("unavailable: ")
        assert "--local-reads" in client.local_reads_status
    assert match.payloads == BLOCKS


def test_a_store_no_other_process_reads_refuses_the_flag(
    make_server: Callable[..., ServerProcess],
) -> None:
    with pytest.raises(RuntimeError, match="--local-reads does not apply to the memory store"):
        make_server(store="memory://", local_reads="true")


def test_an_offer_from_another_host_is_refused(tmp_path: Path) -> None:
    offer = LocalReadsResponse(
        path=str(tmp_path),
        store_id="0" * 32,
        boot_id="another-boot",
        seed="s",
        tenant="",
        retention={"chat": 60.0},
        slack_seconds=1.0,
        default_block_size=16,
        block_sizes={},
    )
    with pytest.raises(LocalReadsUnavailable, match="another host"):
        LocalReads(offer, host_boot_id="this-boot")
    with pytest.raises(LocalReadsUnavailable, match="no LMDB store"):
        LocalReads(offer, host_boot_id="another-boot")  # same host, but no store there


def test_a_block_size_the_service_refuses_is_its_answer_not_a_local_error(
    local_server: ServerProcess,
) -> None:
    with CacheClient(local_server.url, local_reads=True) as client:
        with pytest.raises(ServiceError) as refused:
            client.lookup(MODEL, PROMPT, fetch=True, block_size=-1)
        assert refused.value.status == 422
        match = client.lookup(MODEL, PROMPT, fetch=True)  # the connection is still good
    assert match.payloads == BLOCKS
