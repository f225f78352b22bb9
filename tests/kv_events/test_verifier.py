"""The verify hook: each engine's scheme and seed against the hashes its events carry."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service.core.engines.block_hashes import EngineBlockHash, normalize_block_hash
from cache_service.core.engines.chain_memo import ChainMemo, prompt_chain
from cache_service.core.engines.routing import EngineSpec, RouteScorer
from cache_service.core.engines.schemes import (
    ExtraKeys,
    scheme_named,
    scheme_names,
    untagged_extra_keys,
)
from cache_service.core.engines.views import EngineViews
from cache_service.service.kv_events.config import EngineConfig
from cache_service.service.kv_events.verifier import UNVERIFIABLE_STARTS_WARNING, SchemeVerifier
from tests.kv_events.prompts import (
    LORA_PATH,
    decoded,
    lora_modules,
    prompt_events,
    published_hashes,
)
from tests.kv_events.publisher import stored

VLLM = ("vllm-sha256-cbor", "vllm-xxhash-cbor", "vllm-sha256", "vllm-xxhash")
TOKENS = list(range(100, 164))  # four blocks of 16


def engine(
    scheme: str | None,
    seed: str | None = "0",
    block_size: int = 16,
    *,
    loras: tuple[str | None, ...] = (),
    extra_keys_form: str = "tagged",
) -> EngineConfig:
    return EngineConfig(
        name="e",
        endpoint="tcp://127.0.0.1:5557",
        hash_scheme=scheme,
        seed=seed,
        block_size=block_size,
        extra_keys_form=extra_keys_form,
        lora_modules=lora_modules(*loras),
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
    events = prompt_events(scheme, TOKENS, seed="42", splits=[3, 1])
    events[0]["extra_keys"] = [None, None, None]  # newer vLLM: block 0 is not salted
    first, chained = decoded(events)
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
    events = prompt_events("vllm-sha256-cbor", TOKENS, seed="0")
    events[0]["extra_keys"] = [None] * 4  # newer vLLM: block 0 shows it is not salted
    (event,) = decoded(events)
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
    config = engine("vllm-sha256-cbor", loras=("adapter-A",))
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
    salted[0]["extra_keys"] = None  # an older event: the salt is unknown, so it cannot tell
    assert verifier(config, decoded(salted)[0]) is None
    assert verifier.last_mismatch("e") is None


@pytest.mark.parametrize("int_hashes", [True, False])
@pytest.mark.parametrize("scheme", VLLM)
def test_a_salted_start_without_extra_keys_is_no_alarm(
    scheme: str, int_hashes: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Older vLLM events do not show block 0's cache_salt: the right seed must not alarm."""
    config = engine(scheme, seed="0")
    verifier = SchemeVerifier([config])
    events = prompt_events(scheme, TOKENS, seed="0", int_hashes=int_hashes)
    hashes = published_hashes(scheme, TOKENS, seed="0", int_hashes=int_hashes, cache_salt="t")
    events[0]["block_hashes"] = hashes
    with caplog.at_level(logging.WARNING, logger="cache_service.kv_events"):
        assert verifier(config, decoded(events)[0]) is None
    assert verifier.last_mismatch("e") is None and verifier.known_states("e") == 0
    assert "PYTHONHASHSEED" not in caplog.text and "not reproduced" not in caplog.text


def test_an_engine_whose_starts_are_never_verifiable_is_reported_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Older vLLM events without extra_keys and a wrong seed look like salted prompts: not a
    mismatch, but after 16 such prompts and none verified the service says it cannot check."""
    config = engine("vllm-sha256", seed="0")
    verifier = SchemeVerifier([config])
    with caplog.at_level(logging.WARNING, logger="cache_service.kv_events"):
        for offset in range(UNVERIFIABLE_STARTS_WARNING + 4):
            tokens = [token + offset for token in TOKENS]
            (event,) = decoded(prompt_events("vllm-sha256", tokens, seed="7"))[:1]
            assert verifier(config, event) is None
    assert verifier.unverifiable_starts("e") == UNVERIFIABLE_STARTS_WARNING + 4
    assert caplog.text.count("could not be verified") == 1
    assert "cache-service doctor" in caplog.text


def test_no_such_report_once_an_unsalted_start_verified(caplog: pytest.LogCaptureFixture) -> None:
    config = engine("vllm-sha256", seed="0")
    verifier = SchemeVerifier([config])
    first = prompt_events("vllm-sha256", TOKENS, seed="0")
    first[0]["extra_keys"] = [None] * 4
    assert verifier(config, decoded(first)[0]) is True
    with caplog.at_level(logging.WARNING, logger="cache_service.kv_events"):
        for offset in range(1, UNVERIFIABLE_STARTS_WARNING + 2):
            tokens = [token + offset for token in TOKENS]
            events = prompt_events("vllm-sha256", tokens, seed="0")
            events[0]["block_hashes"] = published_hashes(
                "vllm-sha256", tokens, seed="0", cache_salt="t"
            )
            assert verifier(config, decoded(events)[0]) is None
    assert "could not be verified" not in caplog.text


def test_an_unsalted_start_with_a_wrong_seed_is_still_a_mismatch() -> None:
    config = engine("vllm-sha256-cbor", seed="0")
    verifier = SchemeVerifier([config])
    events = prompt_events("vllm-sha256-cbor", TOKENS, seed="7")
    events[0]["extra_keys"] = [None] * 4
    assert verifier(config, decoded(events)[0]) is False
    assert "PYTHONHASHSEED differs" in (verifier.last_mismatch("e") or "")


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
    config = engine(scheme, seed=seed, loras=(lora,))
    verifier = SchemeVerifier([config])
    raw = prompt_events(scheme, tokens, seed=seed, splits=splits, lora_name=lora)
    events = decoded(raw)
    assert all(verifier(config, event) is True for event in events)
    if scheme in VLLM:  # a wrong seed shows on the event that starts the prompt...
        wrong = engine(scheme, seed=seed + "x", loras=(lora,))
        # ...when it shows block 0's extra keys; without them a salt could explain it.
        assert SchemeVerifier([wrong])(wrong, events[0]) is None
        raw[0]["extra_keys"] = [[lora] if lora else None] * splits[0]
        assert SchemeVerifier([wrong])(wrong, decoded(raw)[0]) is False


def test_a_salted_vllm_032_event_verifies_with_no_alarm(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM 0.32 hashes ("cache_salt", salt) and publishes the bare salt: reproduced, never
    the false alarm that the hash algorithm or PYTHONHASHSEED differs."""
    config = engine("vllm-sha256")
    verifier = SchemeVerifier([config])
    events = prompt_events("vllm-sha256", TOKENS, seed="0", splits=[2, 2])
    events[0]["block_hashes"] = published_hashes("vllm-sha256", TOKENS, seed="0", cache_salt="t")[
        :2
    ]
    events[1]["block_hashes"] = published_hashes("vllm-sha256", TOKENS, seed="0", cache_salt="t")[
        2:
    ]
    events[1]["parent_block_hash"] = events[0]["block_hashes"][-1]
    events[0]["extra_keys"] = [["t"], None]
    events[1]["extra_keys"] = [None, None]
    with caplog.at_level(logging.WARNING, logger="cache_service.kv_events"):
        assert [verifier(config, event) for event in decoded(events)] == [True, True]
    assert verifier.last_mismatch("e") is None and not caplog.text


def test_a_lora_event_whose_path_is_not_configured_cannot_tell_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = engine("vllm-sha256-cbor")  # no lora_modules
    verifier = SchemeVerifier([config])
    events = prompt_events("vllm-sha256-cbor", TOKENS, seed="0", lora_name="adapter-A")
    events[0]["extra_keys"] = [["adapter-A"]] * 4
    with caplog.at_level(logging.WARNING, logger="cache_service.kv_events"):
        for _ in range(3):
            assert verifier(config, decoded(events)[0]) is None
    assert verifier.last_mismatch("e") is None
    assert caplog.text.count("'adapter-A' is not in the engine's lora_modules") == 1
    served = engine("vllm-sha256-cbor", loras=("adapter-A",))
    assert SchemeVerifier([served])(served, decoded(events)[0]) is True


@pytest.mark.parametrize(
    ("engine_form", "configured"), [("tagged", "untagged"), ("untagged", "tagged")]
)
def test_an_engine_of_the_other_extra_keys_form_is_named_not_alarmed(
    engine_form: str, configured: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = engine("vllm-sha256", loras=("l",), extra_keys_form=configured)
    verifier = SchemeVerifier([config])
    with caplog.at_level(logging.WARNING, logger="cache_service.kv_events"):
        for salt in ("a", "b"):
            events = prompt_events(
                "vllm-sha256", TOKENS, seed="0", lora_name="l", extra_keys_form=engine_form
            )
            events[0]["block_hashes"] = published_hashes(
                "vllm-sha256",
                TOKENS,
                seed="0",
                lora_name="l",
                cache_salt=salt,
                extra_keys_form=engine_form,
            )
            events[0]["extra_keys"] = [["l", salt], ["l"], ["l"], ["l"]]
            assert verifier(config, decoded(events)[0]) is None  # no mismatch: seed is right
    assert verifier.last_mismatch("e") is None
    assert verifier.wrong_form_events("e") == 2
    assert f"extra_keys_form = {engine_form!r}" in (verifier.last_wrong_form("e") or "")
    assert caplog.text.count("reproduced only with the other extra-keys form") == 1
    assert "PYTHONHASHSEED" not in caplog.text


# --- feeding the route memo -------------------------------------------------------------

LONG = [(7 + i * 7919) % 50_000 for i in range(40 * 16)]  # 40 blocks: 2 whole segments


def counted_chain(
    scheme_name: str, tokens: list[int], memo: ChainMemo, **keys: str | None
) -> tuple[list[EngineBlockHash], int]:
    """The prompt's chain through the memo, and how many blocks had to be hashed."""
    steps = 0
    inner = scheme_named(scheme_name, seed="0")

    def step(parent: Any, block: Any, extra: Any) -> Any:
        nonlocal steps
        steps += 1
        return inner.step(parent, block, extra)

    counted = replace(inner, step=step)
    return prompt_chain(counted, tokens, block_size=16, memo=memo, **keys), steps


@pytest.mark.parametrize("scheme", scheme_names())
def test_stored_events_fill_the_route_memo_with_the_segments_they_complete(scheme: str) -> None:
    config = engine(scheme)
    memo = ChainMemo()
    verifier = SchemeVerifier([config], chain_memo=memo)
    events = decoded(prompt_events(scheme, LONG, seed="0", splits=[5, 13, 7, 15]))
    assert all(verifier(config, event) for event in events)
    assert len(memo) == 2  # blocks 0-15 and 16-31; 32-39 close no segment
    chain, steps = counted_chain(scheme, LONG, memo)
    assert chain == scheme_named(scheme, seed="0").normalized(LONG, block_size=16)
    assert steps == 8  # only the 8 blocks past the last whole segment
    assert memo.stats()["hits"] == 2


def test_an_event_whose_parent_was_never_seen_feeds_nothing() -> None:
    config = engine("vllm-sha256-cbor")
    memo = ChainMemo()
    verifier = SchemeVerifier([config], chain_memo=memo)
    _, second = decoded(
        prompt_events("vllm-sha256-cbor", LONG, seed="0", splits=[4, 36], int_hashes=False)
    )
    assert verifier(config, second) is True  # bytes hashes chain without the parent...
    assert len(memo) == 0  # ...but the prefix's tokens are unknown: no memo entry
    assert verifier.memo_feed is not None and verifier.memo_feed.skipped == 1


def test_a_salted_prompt_is_memoized_under_its_salt_only() -> None:
    scheme = "vllm-sha256"
    config = engine(scheme, loras=("l",))
    memo = ChainMemo()
    verifier = SchemeVerifier([config], chain_memo=memo)
    hashes = published_hashes(scheme, LONG, seed="0", cache_salt="s1", lora_name="l")
    # vLLM 0.32's events carry the keys untagged: the bare LoRA name and salt.
    keys = [untagged_extra_keys(i, "l", None, "s1") for i in range(40)]
    events = [
        stored(
            hashes[start:end],
            parent_block_hash=hashes[start - 1] if start else None,
            token_ids=LONG[start * 16 : end * 16],
            lora_name="l",
            extra_keys=[list(k) if k else None for k in keys[start:end]],
        )
        for start, end in ((0, 10), (10, 40))
    ]
    assert [verifier(config, event) for event in decoded(events)] == [True, True]
    assert len(memo) == 2
    lora = {"lora_name": "l", "lora_path": LORA_PATH}
    _, salted_steps = counted_chain(scheme, LONG, memo, cache_salt="s1", **lora)
    _, unsalted_steps = counted_chain(scheme, LONG, memo, **lora)
    _, elsewhere_steps = counted_chain(scheme, LONG, memo, lora_name="l", lora_path="/b")
    assert (salted_steps, unsalted_steps, elsewhere_steps) == (8, 40, 40)


def test_blocks_with_multimodal_extra_keys_are_never_memoized() -> None:
    scheme = "vllm-sha256-cbor"
    config = engine(scheme)
    memo = ChainMemo()
    verifier = SchemeVerifier([config], chain_memo=memo)
    # vLLM 0.32 hashes ("mm", identifier, offset) and publishes (identifier, offset).
    keys: list[ExtraKeys] = [(("mm", "img-hash", 0),) if i == 3 else None for i in range(40)]
    raw = scheme_named(scheme, seed="0").block_hashes(LONG, block_size=16, extra_keys_by_block=keys)
    hashes = [int(normalize_block_hash(value)) for value in raw]
    event = stored(
        hashes,
        token_ids=LONG,
        extra_keys=[[["img-hash", 0]] if k else None for k in keys],
    )
    assert verifier(config, decoded([event])[0]) is True
    assert len(memo) == 0


def test_a_mismatching_prompt_feeds_nothing() -> None:
    config = engine("vllm-sha256", seed="0")
    memo = ChainMemo()
    verifier = SchemeVerifier([config], chain_memo=memo)
    events = prompt_events("vllm-sha256", LONG, seed="1")
    events[0]["extra_keys"] = [None] * 40
    (event,) = decoded(events)
    assert verifier(config, event) is False
    assert len(memo) == 0


def test_the_memos_links_are_bounded_by_the_known_states_bound() -> None:
    config = engine("xxh3-64-1337")
    memo = ChainMemo()
    verifier = SchemeVerifier([config], chain_memo=memo, max_known_states_per_engine=20)
    for event in decoded(prompt_events("xxh3-64-1337", LONG, seed="0", splits=[20, 20])):
        verifier(config, event)
    assert verifier.memo_feed is not None and verifier.memo_feed.blocks("e") == 20
    assert len(memo) == 2


@settings(max_examples=40, deadline=None)
@given(
    scheme=st.sampled_from(scheme_names()),
    blocks=st.integers(1, 70),
    cuts=st.lists(st.integers(1, 69), max_size=6),
    shared=st.integers(0, 70),
    data=st.data(),
)
def test_scores_with_an_ingestion_fed_memo_equal_the_full_hash_reference(
    scheme: str, blocks: int, cuts: list[int], shared: int, data: st.DataObject
) -> None:
    config = engine(scheme)
    tokens = data.draw(
        st.lists(st.integers(0, 2**32 - 1), min_size=blocks * 16, max_size=blocks * 16 + 15)
    )
    splits_at = sorted({cut for cut in cuts if cut < blocks})
    splits = [b - a for a, b in zip([0, *splits_at], [*splits_at, blocks], strict=True)]
    memo = ChainMemo(segment_blocks=data.draw(st.sampled_from([1, 4, 16])))
    verifier = SchemeVerifier([config], chain_memo=memo)
    views = EngineViews(max_blocks_per_engine=1 << 12)
    events = decoded(prompt_events(scheme, tokens[: blocks * 16], seed="0", splits=splits))
    for event in events:
        verifier(config, event)
    views.apply_events("e", 0, events)
    assert len(memo) == blocks // memo.segment_blocks  # every whole segment, however split
    # The scored prompt shares `shared` blocks with the stored one, then differs.
    prompt = tokens[: shared * 16] + [t ^ 1 for t in tokens[shared * 16 :]]
    specs = [EngineSpec("e", scheme, "0", 16)]
    fed = RouteScorer(views, memo=memo).score(prompt, specs)
    reference = RouteScorer(views, full_hash=True).score(prompt, specs)
    assert fed == reference
    # Every whole segment the two prompts share came from the fed memo.
    assert memo.stats()["hits"] == min(shared, blocks) // memo.segment_blocks
