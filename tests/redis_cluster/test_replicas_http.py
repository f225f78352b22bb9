"""`cache-service serve` processes on a real Redis Cluster (and a single redis-server): what
one replica stores, pins or purges, the other sees; Redis refusing or gone is a clear problem
or a miss, never a 500."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from bench.redis_cluster import LocalRedisCluster
from cache_service.client import CacheClient
from cache_service.core.framing import MEDIA_TYPE, encode_frames, join_frames
from cache_service.core.tokens import tokens_to_bytes
from cache_service.service.api_keys import Role, key_file_entry, new_key
from tests.integration.conftest import ServerProcess, free_port, service_command
from tests.redis_cluster.conftest import start_cluster
from tests.redis_cluster.nodes import MEMORY, single_node

PROMPT = list(range(9000, 9000 + 64 * 40))  # 40 blocks of 64


def redis_url(cluster: LocalRedisCluster) -> str:
    """The store URL naming every primary."""
    return "redis://" + ",".join(f"{a.host}:{a.port}" for a in cluster.primaries())


def test_two_replicas_share_one_cache(
    cluster: LocalRedisCluster, make_server: Callable[..., ServerProcess]
) -> None:
    cluster.flush_all()
    url = redis_url(cluster)
    one = make_server(store=url, touch_flush_interval="0.05")
    two = make_server(store=url, touch_flush_interval="0.05")
    payloads = [bytes([i]) * 4096 for i in range(40)]
    with CacheClient(one.url) as writer, CacheClient(two.url) as reader:
        stored = writer.store("m", PROMPT, payloads)
        assert stored.stored_blocks == 40
        hit = reader.lookup("m", PROMPT, fetch=True)
        assert hit.matched_blocks == 40
        assert hit.payloads is not None and [bytes(p) for p in hit.payloads] == payloads
        again = reader.store("m", PROMPT, payloads)  # the same blocks from the other replica
        assert again.stored_blocks == 0
        info = httpx.get(two.url + "/v1/info").json()
        assert "redis" in str(info).lower()
        pinned = httpx.post(one.url + "/v1/pin", json={"model": "m", "tokens": PROMPT[:128]})
        assert pinned.status_code == 200, pinned.text
        assert pinned.json()["pinned_blocks"] == 2
        listed = httpx.get(two.url + "/v1/pins").json()  # the other replica sees the pin
        assert [pin["blocks"] for pin in listed["pins"]] == [2], listed
        under = httpx.post(one.url + "/v1/purge", json={"model": "m", "tokens": PROMPT[: 64 * 30]})
        assert under.status_code == 200, under.text
        assert under.json()["blocks"] == 11  # block 29 and the 10 under it
        assert reader.lookup("m", PROMPT).matched_blocks == 29


def test_the_capacity_is_redis_maxmemory(
    cluster: LocalRedisCluster, make_server: Callable[..., ServerProcess]
) -> None:
    server = make_server(store=redis_url(cluster))
    info = httpx.get(server.url + "/v1/info").json()
    assert (info["store"], info["capacity_bytes"]) == ("redis", 3 * 64 * 2**20)
    metrics = httpx.get(server.url + "/metrics").text
    assert "prompt_cache_capacity_bytes 2.01326592e+08" in metrics  # 3 x 64 MiB


def test_an_eviction_policy_named_for_redis_starts_with_a_warning(
    cluster: LocalRedisCluster, make_server: Callable[..., ServerProcess]
) -> None:
    """`--eviction-policy lru` was the default, so Redis deployments may name it: since
    adaptive took over it must still start (Redis evicts by its own rule), and say so."""
    server = make_server(store=redis_url(cluster), eviction_policy="lru")
    assert httpx.get(server.url + "/v1/info").json()["store"] == "redis"
    log = server.log_path.read_text()
    assert "--eviction-policy lru has no effect on the Redis store" in log
    assert "--eviction-policy changed since the last run" not in log  # not in its record


def serve_refused(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """`cache-service serve` with flags that must be refused at start-up."""
    args = [*service_command(), "serve", "--host", "127.0.0.1", "--port", str(free_port())]
    return subprocess.run(
        [*args, *flags], capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False
    )


def test_tenant_quotas_and_a_bad_redis_are_refused_at_start_up_with_the_reason(
    cluster: LocalRedisCluster, tmp_path: Path
) -> None:
    key_file = tmp_path / "keys.toml"
    writer = key_file_entry("a-writer", "team-a", Role.parse("writer"), new_key())
    key_file.write_text(writer + '\n[tenants.team-a]\ncapacity = "1MiB"\n')
    refused = serve_refused(
        tmp_path, "--store", redis_url(cluster), "--auth", "keys", "--api-keys-file", str(key_file)
    )
    assert refused.returncode != 0
    assert "tenant capacity quotas" in refused.stderr and "team-a" in refused.stderr
    assert "Traceback" not in refused.stderr
    sized = serve_refused(tmp_path, "--store", redis_url(cluster), "--capacity", "1GiB")
    assert sized.returncode != 0 and "--capacity do not apply to the Redis store" in sized.stderr
    nobody = serve_refused(tmp_path, "--store", f"redis://127.0.0.1:{free_port()}")
    assert nobody.returncode != 0 and "no Redis node" in nobody.stderr
    assert "Traceback" not in nobody.stderr


def test_redis_gone_is_a_miss_for_lookups_and_a_503_with_retry_after_for_stores(
    tmp_path: Path, make_server: Callable[..., ServerProcess]
) -> None:
    with single_node(tmp_path, *MEMORY) as (process, port):
        server = make_server(store=f"redis://127.0.0.1:{port}", touch_flush_interval="0.05")
        with CacheClient(server.url) as client:
            client.store("m", PROMPT[:128], [b"a" * 100, b"b" * 100])
            assert client.lookup("m", PROMPT[:128]).matched_blocks == 2
        process.kill()
        process.wait()
        lookup = httpx.post(server.url + "/v1/lookup", json={"model": "m", "tokens": PROMPT[:128]})
        assert lookup.status_code == 200 and lookup.json()["matched_blocks"] == 0
        frame = httpx.post(
            server.url + "/v1/lookup", json={"model": "m", "tokens": PROMPT[:128], "fetch": True}
        )
        assert frame.status_code == 200
        header = {"model": "m", "start_block": 2}
        body = join_frames(encode_frames(header, [tokens_to_bytes(PROMPT[:192]), b"c" * 100]))
        refused = httpx.post(
            server.url + "/v1/blocks",
            content=body,
            headers={"content-type": MEDIA_TYPE},
            timeout=30,
        )
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["type"].endswith("/storage-failure")
        time.sleep(1.5)  # the counters follow the store once a second
        metrics = httpx.get(server.url + "/metrics").text
        assert _sample(metrics, "prompt_cache_backend_lookup_errors_total") >= 2
        assert _sample(metrics, "prompt_cache_backend_write_failures_total") == 1
        assert _sample(metrics, "prompt_cache_backend_write_retries_total") >= 1


def _sample(text: str, name: str) -> float:
    """The value of an unlabelled sample in a Prometheus text exposition."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exposed")


def test_a_whole_cluster_gone_is_misses_and_503s_never_a_500(
    tmp_path: Path, make_server: Callable[..., ServerProcess]
) -> None:
    gone = start_cluster(tmp_path / "gone", for_the_store=True)
    try:
        server = make_server(store=redis_url(gone), touch_flush_interval="0.05")
        with CacheClient(server.url) as client:
            client.store("m", PROMPT[:128], [b"a" * 100, b"b" * 100])
    finally:
        gone.stop()  # every node
    lookup = httpx.post(server.url + "/v1/lookup", json={"model": "m", "tokens": PROMPT[:128]})
    assert lookup.status_code == 200 and lookup.json()["matched_blocks"] == 0
    body = join_frames(encode_frames({"model": "m"}, [tokens_to_bytes(PROMPT[:64]), b"c" * 100]))
    frames = {"content-type": MEDIA_TYPE}
    store = httpx.post(server.url + "/v1/blocks", content=body, headers=frames, timeout=60)
    assert store.status_code == 503 and "retry-after" in store.headers, store.text
    for method, path, payload in (
        ("POST", "/v1/pin", {"model": "m", "tokens": PROMPT[:128]}),
        ("GET", "/v1/pins", None),
        ("POST", "/v1/purge", {"model": "m"}),
    ):
        answer = httpx.request(method, server.url + path, json=payload, timeout=60)
        assert answer.status_code == 503, (path, answer.status_code, answer.text)
        assert answer.json()["type"].endswith("/storage-failure")


def test_worker_processes_of_one_replica_share_the_cluster_and_the_machine_files(
    cluster: LocalRedisCluster, make_server: Callable[..., ServerProcess]
) -> None:
    cluster.flush_all()
    metrics_port = free_port()
    server = make_server(
        store=redis_url(cluster),
        workers="2",
        touch_flush_interval="0.05",
        metrics_port=str(metrics_port),
    )
    payloads = [bytes([i]) * 512 for i in range(8)]
    with CacheClient(server.url) as client:
        assert client.store("m", PROMPT[: 64 * 8], payloads).stored_blocks == 8
        for _ in range(8):  # answered by either worker
            assert client.lookup("m", PROMPT[: 64 * 8]).matched_blocks == 8
    # One worker serves the metrics port, elected through a lock file in --data-dir.
    assert (server.data_dir / "metrics.lock").exists()
    assert "prompt_cache_blocks" in httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
    assert not list(server.data_dir.glob("*.mdb"))  # and no LMDB data beside it
