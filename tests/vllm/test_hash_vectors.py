"""The installed vLLM still hashes blocks as the pinned vectors say (tests/engines/
vllm_vectors.py): its generator is run live in the vLLM environment, so a vLLM upgrade that
changes block hashing (the extra keys' tags, the default seed, the serializers) fails here,
loudly, before routing scores silently match nothing."""

from __future__ import annotations

import json
import os
import subprocess

from tests.engines.vllm_vectors import PINNED
from tests.vllm.conftest import REPO, VLLM_PYTHON


def test_the_installed_vllm_hashes_blocks_as_the_pinned_vectors_say() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHE_SERVICE_")}
    env.pop("PYTHONHASHSEED", None)  # the generator sets and unsets it itself
    done = subprocess.run(
        [str(VLLM_PYTHON), "-m", "tests.engines.vllm_vectors"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    live = json.loads(done.stdout)
    # Another release that hashes alike passes: only the hashing is held, not the version.
    differ = [
        f"{scheme}, seed {seed}, prompt {prompt}"
        for scheme, seeds in PINNED["hashes"].items()
        for seed, prompts in seeds.items()
        for prompt, hashes in prompts.items()
        if live["hashes"].get(scheme, {}).get(seed, {}).get(prompt) != hashes
    ]
    why = (
        f"vLLM {live['vllm']} (installed) does not hash as vLLM {PINNED['vllm']} (pinned): "
        "make the schemes (and extra_keys_form) reproduce it, then re-pin the vectors"
    )
    assert not differ, f"{why}; differing: {differ}"
    assert live["random_when_unset"] == PINNED["random_when_unset"], why
    assert live["event_extra_keys"] == PINNED["event_extra_keys"], why
