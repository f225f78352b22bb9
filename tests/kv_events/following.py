"""A real server following two engines' real publishers (for /v1/route tests)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from tests.integration.conftest import ServerProcess
from tests.kv_events.publisher import WIRES, TestPublisher

BLOCK = 16
SCHEME, SEED = "vllm-sha256-cbor", "0"


@pytest.fixture
def publishers() -> Iterator[dict[str, TestPublisher]]:
    """Two engines' publishers on 127.0.0.1, in the newest vLLM wire; closed at the end."""
    context: zmq.Context[Any] = zmq.Context()
    opened = {name: TestPublisher(context, wire=WIRES["vllm-map-batch"]) for name in ("a", "b")}
    yield opened
    for publisher in opened.values():
        publisher.close()
    context.term()


@pytest.fixture
def following(
    make_server: Callable[..., ServerProcess], publishers: dict[str, TestPublisher], tmp_path: Path
) -> ServerProcess:
    """A server following engines `engine-a` and `engine-b` (SCHEME, SEED, blocks of BLOCK)."""
    config = tmp_path / "engines.toml"
    tables = "\n".join(
        f'[[engine]]\nname = "engine-{name}"\nendpoint = "{publisher.endpoint}"\n'
        for name, publisher in publishers.items()
    )
    config.write_text(
        f'[defaults]\nblock_size = {BLOCK}\nhash_scheme = "{SCHEME}"\nseed = "{SEED}"\n\n{tables}'
    )
    server = make_server(block_size=str(BLOCK), kv_events_config=str(config))
    for publisher in publishers.values():
        publisher.wait_for_subscriber(timeout_seconds=10)
    return server
