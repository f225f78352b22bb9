"""The connector refuses, at engine start, a configuration under which it could not fail open.

Run in the vLLM environment (the connector subclasses vLLM's base class), on vLLM's own
`KVTransferConfig`; the rest of the engine's config is a stand-in, as the checks read nothing
else before refusing.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.vllm.conftest import REPO, VLLM_PYTHON

SCRIPT = """
import json, sys
from types import SimpleNamespace
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from cache_service.integrations.vllm import PromptCacheConnector

config = KVTransferConfig(**json.loads(sys.argv[1]))
try:
    vllm_config = SimpleNamespace(kv_transfer_config=config)
    PromptCacheConnector(vllm_config, KVConnectorRole.SCHEDULER, None)
except ValueError as exc:
    print("REFUSED", exc)
"""


def _refusal(config: dict[str, object]) -> str:
    full = {
        "kv_connector": "PromptCacheConnector",
        "kv_connector_module_path": "cache_service.integrations.vllm",
        "kv_role": "kv_both",
        **config,
    }
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", SCRIPT, json.dumps(full)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("REFUSED")]
    assert lines, done.stdout + done.stderr
    return lines[0]


@pytest.mark.parametrize("policy", [None, "fail"])
def test_a_load_failure_policy_that_would_fail_requests_is_refused_naming_the_fix(
    policy: str | None,
) -> None:
    config: dict[str, object] = {} if policy is None else {"kv_load_failure_policy": policy}
    refusal = _refusal(config)
    assert '"kv_load_failure_policy": "recompute"' in refusal
    assert "--kv-transfer-config" in refusal


def test_an_unknown_extra_config_key_is_refused_naming_it() -> None:
    refusal = _refusal(
        {
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"urll": "http://127.0.0.1:8080"},
        }
    )
    assert "'urll'" in refusal
