"""The verify hook: each engine's scheme and seed against the hashes its events carry."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service.core.engines.schemes import scheme_names
from cache_service.service.kv_events.config import EngineConfig
from cache_service.service.kv_events.verifier import SchemeVerifier
from tests.kv_events.prompts import decoded, prompt_events

VLLM = ("vllm-sha256-cbor", "vllm-xxhash-cbor", "vllm-sha256", "vllm-xxhash")
TOKENS = list(range(100, 164))  # four blocks of 16


def engine(scheme: str | None, seed: str | None = "0", block_size: int = 16) -> EngineConfig:
    return EngineConfig(
        name="e",
        endpoint="tcp://127.0.0.1:5557",
        hash_scheme=scheme,
        seed=seed,
        block_size=block_size,
    )


@pytest.mark.parametrize("scheme", scheme_names())
def test_a_prompt_stored_over_several_events_verifies_through_its_known_parents(
    scheme: str,
) -> None:
    config = engine(scheme)
    verifier = SchemeVerifier([config])
    events = decoded(prompt_events(scheme, TOKENS, seed="0", splits=[2, 1, 1]))
    assert [verifier(config, event) for event in events] == [True, True, True]
    assert verifier.known_states("e") == 4
    assert verifier.last_mismatch("e") is None


@pytest.mark.parametrize("scheme", VLLM)
def test_a_wrong_seed_is_a_mismatch_on_the_event_that_starts_the_prompt(
    scheme: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = engine(scheme, seed="0")
    verifier = SchemeVerifier([config])
    first, chained = decoded(prompt_events(scheme, TOKENS, seed="42", splits=[3, 1]))
    with caplog.at_level(logging.WARNING, logger="cache_service.kv_events"):
        assert verifier(config, first) is False
    # Its parent never verified: the chained event cannot tell, and is never a mismatch.
    assert verifier(config, chained) is None
    reason = verifier.last_mismatch("e")
    assert reason is not None
    assert reason.startswith(f"an event that starts a prompt: block 0: {scheme} gives")
    assert reason.endswith(
        "PYTHONHASHSEED differs from the configuration (run `cache-service doctor`)"
    )
    assert "engine e" in caplog.text and "block 0" in caplog.text


def test_digest_bytes_chain_without_having_seen_the_parent() -> None:
    config = engine("vllm-sha256-cbor")
    verifier = SchemeVerifier([config])
    _, chained = decoded(
        prompt_events("vllm-sha256-cbor", TOKENS, seed="0", splits=[2, 2], int_hashes=False)
    )
    assert verifier(config, chained) is True  # the parent's digest is its chain state


def test_an_int_parent_never_seen_cannot_tell() -> None:
    config = engine("vllm-sha256")
    verifier = SchemeVerifier([config])
    _, chained = decoded(prompt_events("vllm-sha256", TOKENS, seed="0", splits=[2, 2]))
    assert verifier(config, chained) is None
    assert verifier.last_mismatch("e") is None


def test_another_scheme_is_a_mismatch() -> None:
    config = engine("vllm-sha256")
    verifier = SchemeVerifier([config])
    (event,) = decoded(prompt_events("vllm-sha256-cbor", TOKENS, seed="0"))
    assert verifier(config, event) is False
    reason = verifier.last_mismatch("e") or ""
    assert reason.startswith("an event that starts a prompt: block 0: vllm-sha256 gives")


def test_an_engine_storing_other_block_sizes_is_a_mismatch() -> None:
    config = engine("sglang", block_size=16)
    verifier = SchemeVerifier([config])
    (event,) = decoded(prompt_events("sglang", TOKENS, seed=None, block_size=32))
    assert verifier(config, event) is False
    assert verifier.last_mismatch("e") == (
        "the engine stores blocks of 32 tokens, the configuration says 16 (block_size)"
    )


def test_lora_names_and_extra_keys_are_hashed_as_vllm_does() -> None:
    config = engine("vllm-sha256-cbor")
    verifier = SchemeVerifier([config])
    lora = decoded(prompt_events("vllm-sha256-cbor", TOKENS, seed="0", lora_name="adapter-A"))
    assert verifier(config, lora[0]) is True
    # Newer vLLM events carry each block's extra keys (here block 0's cache salt).
    salted = prompt_events("vllm-sha256-cbor", TOKENS[:16], seed="0")
    from tests.kv_events.prompts import published_hashes  # noqa: PLC0415

    salted[0]["block_hashes"] = published_hashes(
        "vllm-sha256-cbor", TOKENS[:16], seed="0", cache_salt="tenant-salt"
    )
    salted[0]["extra_keys"] = [["tenant-salt"]]
    assert verifier(config, decoded(salted)[0]) is True
    salted[0]["extra_keys"] = None  # an older event: the salt is unknown
    assert verifier(config, decoded(salted)[0]) is False


def test_events_that_cannot_tell_are_neither_verified_nor_mismatches() -> None:
    unconfigured = engine(None)
    verifier = SchemeVerifier([unconfigured])
    (event,) = decoded(prompt_events("sglang", TOKENS, seed=None))
    assert verifier(unconfigured, event) is None
    config = engine("sglang")
    bigrams = prompt_events("sglang", TOKENS[:16], seed=None)
    bigrams[0]["token_ids"] = [[t, t + 1] for t in TOKENS[:16]]
    (event,) = decoded(bigrams, wire="sglang-dp")
    assert event.bigram_tokens
    assert SchemeVerifier([config])(config, event) is None


def test_known_states_are_bounded_and_the_oldest_go_first() -> None:
    config = engine("sglang")
    verifier = SchemeVerifier([config], max_known_states_per_engine=2)
    first, second, third = decoded(prompt_events("sglang", TOKENS, seed=None, splits=[2, 1, 1]))
    assert verifier(config, first) is True
    assert verifier.known_states("e") == 2
    assert verifier(config, third) is None  # its parent (block 2) was never verified
    assert verifier(config, second) is True  # block 1 kept; block 0 dropped for block 2
    assert verifier.known_states("e") == 2
    assert verifier(config, third) is True


@settings(max_examples=30, deadline=None)
@given(
    scheme=st.sampled_from(scheme_names()),
    tokens=st.lists(st.integers(0, 2**31 - 1), min_size=16, max_size=16 * 6),
    seed=st.sampled_from(["0", "1", "42", "random", "00"]),
    lora=st.none() | st.text(min_size=1, max_size=8),
    data=st.data(),
)
def test_any_prompt_split_any_way_verifies_with_the_engines_own_seed(
    scheme: str, tokens: list[int], seed: str, lora: str | None, data: st.DataObject
) -> None:
    blocks = len(tokens) // 16
    tokens = tokens[: blocks * 16]
    splits: list[int] = []
    while sum(splits) < blocks:
        splits.append(data.draw(st.integers(1, blocks - sum(splits))))
    config = engine(scheme, seed=seed)
    verifier = SchemeVerifier([config])
    events = decoded(prompt_events(scheme, tokens, seed=seed, splits=splits, lora_name=lora))
    assert all(verifier(config, event) is True for event in events)
    if scheme in VLLM:  # a wrong seed shows on the event that starts the prompt
        wrong = engine(scheme, seed=seed + "x")
        assert SchemeVerifier([wrong])(wrong, events[0]) is False
