"""The problem type only a service on a remote store sends, provoked from a real one on a
single redis-server and read by the client: its class, field and reason (the rest:
tests/integration/test_client_problems.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from cache_service.client import CacheClient, ServiceError, StorageFailureProblem
from tests.integration.conftest import ServerProcess
from tests.redis_cluster.nodes import MEMORY, single_node

PROMPT = list(range(64 * 3))  # 3 blocks of the default 64 tokens


def test_a_store_with_redis_gone_is_a_storage_failure(
    tmp_path: Path, make_server: Callable[..., ServerProcess]
) -> None:
    with single_node(tmp_path, *MEMORY) as (process, port):
        server = make_server(store=f"redis://127.0.0.1:{port}")
        with CacheClient(server.url, timeout=30) as client:
            client.store("m", PROMPT[:64], [b"a"])
            process.kill()
            process.wait()
            with pytest.raises(ServiceError) as raised:
                client.store("m", PROMPT, [b"b"], start_block=2)
    failed = raised.value
    assert type(failed) is StorageFailureProblem
    assert (failed.status, failed.problem, failed.field) == (503, "storage-failure", None)
    assert "Redis" in failed.reason, failed.reason
