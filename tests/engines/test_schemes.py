"""Engine hash schemes: golden vectors, vectors published by other projects, chain
properties, and that a wrong seed or scheme never verifies. vLLM 0.32's own vectors (tagged
extra keys, its default seed) are held in test_vllm_vectors.py; golden_vectors.py's are the
older, untagged form's."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service.core.engines.block_hashes import normalize_block_hash
from cache_service.core.engines.schemes import (
    COMMON_SEEDS,
    DEFAULT_SEED,
    SCHEMES,
    EngineHashScheme,
    diagnose_stored_event,
    scheme_named,
    scheme_names,
    verify_stored_event,
)
from tests.engines.golden_vectors import BLOCK_SIZE, GOLDEN, PROMPTS, SEED, reference

VLLM = ("vllm-sha256-cbor", "vllm-xxhash-cbor", "vllm-sha256", "vllm-xxhash")
ALL = (*VLLM, "sglang", "xxh3-64-1337")
U64 = (1 << 64) - 1


def _hex(value: bytes | int) -> str:
    return value.hex() if isinstance(value, bytes) else f"{value & U64:016x}"


def test_registry_names_every_scheme() -> None:
    assert set(scheme_names()) == set(ALL) == set(SCHEMES)
    with pytest.raises(ValueError, match="unknown engine hash scheme"):
        scheme_named("sha256_cbor", seed="0")


@pytest.mark.parametrize("name", ["vllm-xxhash", "vllm-xxhash-cbor"])
def test_an_xxhash_scheme_refuses_to_run_without_a_seed(name: str) -> None:
    """vLLM 0.32 roots xxhash and xxhash_cbor at random bytes when PYTHONHASHSEED is unset."""
    with pytest.raises(ValueError, match=r"PYTHONHASHSEED.*random bytes"):
        scheme_named(name, seed=None)
    assert SCHEMES[name].default_seed is None


@pytest.mark.parametrize("name", ["vllm-sha256", "vllm-sha256-cbor"])
def test_a_sha256_scheme_without_a_seed_takes_vllms_fixed_default(name: str) -> None:
    """vLLM 0.32 roots sha256 and sha256_cbor at "vllm-none-hash" when PYTHONHASHSEED is unset."""
    unset = scheme_named(name, seed=None)
    assert unset.seed == DEFAULT_SEED == SCHEMES[name].default_seed == "vllm-none-hash"
    assert unset.root == scheme_named(name, seed="vllm-none-hash").root
    assert "vllm-none-hash" in SCHEMES[name].engine_settings


def test_doctors_candidate_seeds_start_with_vllms_default() -> None:
    assert COMMON_SEEDS[0] == "vllm-none-hash" and "0" in COMMON_SEEDS


def test_an_unknown_extra_keys_form_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown extra_keys_form 'v2'; known: tagged, untagged"):
        scheme_named("vllm-sha256", seed="0", extra_keys_form="v2")
    assert scheme_named("sglang", extra_keys_form="v2").extra_keys_form is None  # no keys


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_scheme_reproduces_its_pinned_golden_vectors(name: str, prompt: str) -> None:
    tokens, lora, salt = PROMPTS[prompt]
    scheme = scheme_named(name, seed=SEED, extra_keys_form="untagged")
    got = scheme.block_hashes(tokens, block_size=BLOCK_SIZE, lora_name=lora, cache_salt=salt)
    assert [_hex(value) for value in got] == GOLDEN[name][prompt]


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_pinned_vectors_are_what_the_reference_definitions_give(name: str, prompt: str) -> None:
    assert reference(name, prompt) == GOLDEN[name][prompt]


def test_vllm_sha256_matches_mooncake_conductors_published_vectors() -> None:
    """kvcache-ai/Mooncake mooncake-conductor/tests/fixtures/hash_golden_vectors_sha256.json
    (commit 31da207c482d), generated with CPython's pickler from vLLM 0.22.1rc0's recipe."""
    roots = {
        "0": "1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c",
        "00": "67c61e0f70ad5d3fc0eacb59744008ac6f2a8bd2edad43540a743eaf0fb4993c",
        "random": "fa1326fc0ad784c54e10f808051a77f999f7b675b12fba49cbef92b3e1a09cb7",
        "4294967295": "670c2eca46f5f7e11b9dce5c3bd2ff0e9e19567fd45b50c2db5cc0c9aae470d9",
    }
    for seed, root in roots.items():
        assert _hex(scheme_named("vllm-sha256", seed=seed).root or b"") == root
    scheme = scheme_named("vllm-sha256", seed="0", extra_keys_form="untagged")  # vLLM 0.22
    utf8 = scheme.block_hashes(
        [1, 2, 3, 4], block_size=4, lora_name="模型-适配器", cache_salt="盐值-🚀"
    )
    assert _hex(utf8[0]) == "cc1a2ab147f91a34070bb430e35dbc6ca6261a93b490a2307d0b4b31696a247a"
    chain = scheme.normalized([1, 2, 3, 4, 5, 6, 7, 8], block_size=4)
    assert chain == [10362225831949560093, 12472515041799373675]  # their "projected_decimal"


def test_xxh3_chain_matches_dynamos_known_answer() -> None:
    """ai-dynamo/dynamo docs, "KV Events & Hashing Consistency": [1,2,3,4], block 4."""
    scheme = scheme_named("xxh3-64-1337")
    assert scheme.block_hashes([1, 2, 3, 4], block_size=4) == [14643705804678351452]


def test_sglang_publishes_the_signed_first_eight_digest_bytes() -> None:
    scheme = scheme_named("sglang")
    (state,) = scheme.chain([1, 2, 3, 4], block_size=4)
    assert isinstance(state, bytes) and len(state) == 32
    published = scheme.publish(state)
    assert isinstance(published, int) and -(1 << 63) <= published < 1 << 63
    assert published & U64 == int.from_bytes(state[:8], "big")
    assert scheme.recover(published) is None  # 64 of 256 bits cannot be extended


def test_vllm_digests_are_published_whole_and_fold_to_their_last_eight_bytes() -> None:
    for name, size in zip(VLLM, (32, 16, 32, 16), strict=True):
        scheme = scheme_named(name, seed="0")
        (digest,) = scheme.block_hashes([5, 6, 7, 8], block_size=4)
        assert isinstance(digest, bytes) and len(digest) == size
        as_int = int.from_bytes(digest, "big") & U64  # vLLM's maybe_convert_block_hash
        assert normalize_block_hash(digest) == normalize_block_hash(as_int)
        assert scheme.recover(digest) == digest and scheme.recover(as_int) is None


def test_cache_salt_changes_only_vllms_first_block_key_and_lora_every_block() -> None:
    scheme = scheme_named("vllm-sha256-cbor", seed="0")
    tokens = list(range(12))
    rule = scheme.extra_keys_rule
    assert rule(0, "a", "/p", "salt") == (("lora", "a", "/p"), ("cache_salt", "salt"))
    assert rule(1, "a", "/p", "salt") == (("lora", "a", "/p"),)
    assert rule(1, None, None, "salt") is None and rule(0, None, None, "") is None
    old = scheme_named("vllm-sha256-cbor", seed="0", extra_keys_form="untagged").extra_keys_rule
    assert old(0, "a", "/p", "salt") == ("a", "salt")  # older vLLM: no tags, no path
    assert old(1, "a", None, "salt") == ("a",)
    plain = scheme.block_hashes(tokens, block_size=4)
    salted = scheme.block_hashes(tokens, block_size=4, cache_salt="s")
    assert all(a != b for a, b in zip(plain, salted, strict=True))  # the chain carries it on


def test_extra_keys_given_as_lists_hash_like_tuples() -> None:
    """msgpack turns an event's tuples into lists; pickle would tell them apart."""
    for name in VLLM:
        scheme = scheme_named(name, seed="0")
        as_tuple = scheme.extend(None, [1, 2], ("lora", ("mm", 3)))
        assert scheme.extend(None, [1, 2], ["lora", ["mm", 3]]) == as_tuple  # type: ignore[arg-type]
        assert scheme.extend(None, [1, 2], ()) == scheme.extend(None, [1, 2], None)


tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=40)


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(ALL),
    tokens=tokens_st,
    block_size=st.integers(1, 6),
    lora=st.none() | st.text(max_size=5),
    salt=st.none() | st.text(max_size=5),
)
def test_extend_chained_over_blocks_equals_block_hashes(
    name: str, tokens: list[int], block_size: int, lora: str | None, salt: str | None
) -> None:
    scheme = scheme_named(name, seed="7")
    state = None
    chained = []
    for index in range(len(tokens) // block_size):
        block = tokens[index * block_size : (index + 1) * block_size]
        state = scheme.extend(state, block, scheme.extra_keys_rule(index, lora, "/p", salt))
        chained.append(scheme.publish(state))
    assert chained == scheme.block_hashes(
        tokens, block_size=block_size, lora_name=lora, lora_path="/p", cache_salt=salt
    )


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(ALL), tokens=tokens_st, cut=st.integers(0, 40), size=st.integers(1, 6))
def test_a_prefixs_hashes_are_a_prefix_of_the_longer_prompts(
    name: str, tokens: list[int], cut: int, size: int
) -> None:
    scheme = scheme_named(name, seed="7")
    keys = {"lora_name": "l", "lora_path": "/p", "cache_salt": "s"}
    longer = scheme.block_hashes(tokens, block_size=size, **keys)
    shorter = scheme.block_hashes(tokens[:cut], block_size=size, **keys)
    assert longer[: len(shorter)] == shorter
    assert len(shorter) == min(cut, len(tokens)) // size


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(ALL), tokens=st.lists(st.integers(0, 2**32 - 1), min_size=8))
def test_changing_one_token_changes_every_later_block(name: str, tokens: list[int]) -> None:
    scheme = scheme_named(name, seed="7")
    changed = [tokens[0] ^ 1, *tokens[1:]]
    before = scheme.normalized(tokens, block_size=4)
    after = scheme.normalized(changed, block_size=4)
    assert all(a != b for a, b in zip(before, after, strict=True))


def _event(scheme: EngineHashScheme, tokens: list[int], **keys: str) -> dict[str, object]:
    return {
        "parent": None,
        "token_ids": tokens,
        "block_hashes": scheme.block_hashes(tokens, block_size=4, **keys),  # type: ignore[arg-type]
        "block_size": 4,
    }


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(ALL),
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=4, max_size=24),
    lora=st.none() | st.text(min_size=1, max_size=5),
)
def test_an_engines_event_verifies_against_its_own_scheme(
    name: str, tokens: list[int], lora: str | None
) -> None:
    tokens = tokens[: len(tokens) // 4 * 4]
    engine = scheme_named(name, seed="1234")
    hashes = engine.block_hashes(tokens, block_size=4, lora_name=lora, lora_path="/p")
    ours = scheme_named(name, seed="1234")
    result = verify_stored_event(
        ours,
        parent=None,
        token_ids=tokens,
        block_hashes=hashes,
        block_size=4,
        lora_name=lora,
        lora_path="/p",
    )
    assert result.ok and result.reproduced == len(hashes) == len(result.states)


@pytest.mark.parametrize("name", VLLM)
def test_a_wrong_seed_does_not_verify(name: str) -> None:
    engine = scheme_named(name, seed="1")
    event = _event(engine, list(range(8)))
    # A newer event shows block 0 has no extra keys: only the seed can explain it.
    unsalted = [None, None]
    result = verify_stored_event(scheme_named(name, seed="0"), **event, extra_keys=unsalted)  # type: ignore[arg-type]
    assert result.outcome == "mismatch" and result.reproduced == 0
    assert "block 0" in result.reason


@pytest.mark.parametrize("name", VLLM)
@pytest.mark.parametrize("int_hashes", [False, True])
def test_a_salted_start_without_extra_keys_is_unverifiable_not_a_mismatch(
    name: str, int_hashes: bool
) -> None:
    scheme = scheme_named(name, seed="0")
    tokens = list(range(12))
    hashes = scheme.block_hashes(tokens, block_size=4, cache_salt="tenant")
    published = [normalize_block_hash(h) if int_hashes else h for h in hashes]
    result = verify_stored_event(
        scheme, parent=None, token_ids=tokens, block_hashes=published, block_size=4
    )
    assert result.outcome == "unverifiable" and result.keys_unknown
    assert "cache_salt" in result.reason and result.states == ()
    # With the digests, blocks 1.. are checked from block 0's: the algorithm still shows.
    assert ("blocks 1..2 were reproduced" in result.reason) is not int_hashes


@pytest.mark.parametrize("name", VLLM)
def test_a_wrong_algorithm_still_shows_past_block_0_of_an_event_without_extra_keys(
    name: str,
) -> None:
    # A digest of the other length (16 bytes for 32) shows the algorithm at block 0 already.
    other = next(o for o in VLLM if o != name and ("xxhash" in o) == ("xxhash" in name))
    hashes = scheme_named(other, seed="0").block_hashes(list(range(12)), block_size=4)
    result = verify_stored_event(
        scheme_named(name, seed="0"),
        parent=None,
        token_ids=list(range(12)),
        block_hashes=hashes,
        block_size=4,
    )
    assert result.outcome == "mismatch" and "from block 0's published digest" in result.reason
    longer = next(o for o in VLLM if ("xxhash" in o) != ("xxhash" in name))
    hashes = scheme_named(longer, seed="0").block_hashes(list(range(12)), block_size=4)
    event = {"parent": None, "token_ids": list(range(12)), "block_hashes": hashes}
    result = verify_stored_event(scheme_named(name, seed="0"), **event, block_size=4)  # type: ignore[arg-type]
    assert result.outcome == "mismatch" and "bytes" in result.reason


@pytest.mark.parametrize("name", ALL)
def test_a_wrong_scheme_does_not_verify(name: str) -> None:
    event = _event(scheme_named(name, seed="0"), list(range(8)))
    for other in ALL:
        if other != name:
            result = verify_stored_event(scheme_named(other, seed="0"), **event)  # type: ignore[arg-type]
            assert not result.ok, other


@pytest.mark.parametrize("name", ALL)
def test_a_later_event_verifies_from_the_states_of_its_parents_event(name: str) -> None:
    scheme = scheme_named(name, seed="0")
    tokens = list(range(100, 116))
    hashes = scheme.block_hashes(tokens, block_size=4)
    # The engine publishes 64-bit ints by default: the first half, then the rest.
    as_ints = [normalize_block_hash(value) for value in hashes]
    first = verify_stored_event(
        scheme, parent=None, token_ids=tokens[:8], block_hashes=as_ints[:2], block_size=4
    )
    later = {
        "parent": as_ints[1],
        "token_ids": tokens[8:],
        "block_hashes": as_ints[2:],
        "block_size": 4,
    }
    blind = verify_stored_event(scheme, **later)  # type: ignore[arg-type]
    assert blind.outcome == ("reproduced" if name == "xxh3-64-1337" else "unverifiable")
    known = {scheme.normal_form(state): state for state in first.states}
    assert verify_stored_event(scheme, **later, known_states=known).ok  # type: ignore[arg-type]


def test_events_extra_keys_override_the_lora_rule() -> None:
    scheme = scheme_named("vllm-sha256-cbor", seed="0")
    tokens = list(range(8))
    lora = {"lora_name": "a", "lora_path": "/p"}
    hashes = scheme.block_hashes(tokens, block_size=4, cache_salt="salt", **lora)
    common = {"parent": None, "token_ids": tokens, "block_hashes": hashes, "block_size": 4}
    # An older event carries the LoRA name only: a salted prompt cannot tell from it.
    older = verify_stored_event(scheme, **common, **lora)  # type: ignore[arg-type]
    assert older.outcome == "unverifiable" and older.keys_unknown
    keys = [["a", "salt"], ["a"]]  # as vLLM 0.32 publishes them: untagged, no path
    assert verify_stored_event(scheme, **common, extra_keys=keys, **lora).ok  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("tokens", "hashes", "why"),
    [
        ([1, 2, 3], [1], "tokens are not"),
        ([1, 2, 3, 4], [], "no blocks"),
        ([1, 2, 3, 4], ["garbage"], "malformed"),
        ([-1, 2, 3, 4], [1], "token ids"),
    ],
)
def test_malformed_events_are_unverifiable_not_mismatches(
    tokens: list[int], hashes: list[object], why: str
) -> None:
    scheme = scheme_named("xxh3-64-1337")
    result = verify_stored_event(
        scheme,
        parent=None,
        token_ids=tokens,
        block_hashes=hashes,  # type: ignore[arg-type]
        block_size=4,
    )
    assert result.outcome == "unverifiable" and why in result.reason


def _diagnose(engine: str, engine_seed: str, configured: str, seed: str | None) -> str:
    lora = {"lora_name": "x", "lora_path": "/p"}
    event = _event(scheme_named(engine, seed=engine_seed), list(range(8)), **lora)
    return diagnose_stored_event(
        scheme_name=configured,
        seed=seed,
        **lora,
        **event,  # type: ignore[arg-type]
    ).cause


def test_diagnosis_names_a_wrong_scheme_a_wrong_seed_and_an_unknown_root() -> None:
    assert _diagnose("vllm-sha256-cbor", "0", "vllm-sha256-cbor", "0") == "ok"
    assert _diagnose("vllm-xxhash-cbor", "0", "vllm-sha256-cbor", "0") == "wrong-scheme"
    assert _diagnose("sglang", "0", "vllm-sha256-cbor", "0") == "wrong-scheme"
    assert _diagnose("vllm-sha256-cbor", "42", "vllm-sha256-cbor", "0") == "wrong-seed"
    assert _diagnose("vllm-sha256-cbor", "42", "vllm-sha256-cbor", None) == "wrong-seed"
    # vLLM 0.32 with PYTHONHASHSEED unset: its fixed default is among the seeds tried.
    assert _diagnose("vllm-sha256", "vllm-none-hash", "vllm-sha256", "0") == "wrong-seed"
    # An unset PYTHONHASHSEED roots vLLM at random bytes: no seed reproduces it.
    assert _diagnose("vllm-sha256-cbor", "not-a-common-seed", "vllm-sha256", "0") == "unknown"


def test_diagnosis_of_a_salted_start_without_extra_keys_cannot_tell_and_says_why() -> None:
    scheme = scheme_named("vllm-sha256", seed="0")
    tokens = list(range(8))
    hashes = [
        normalize_block_hash(h) for h in scheme.block_hashes(tokens, block_size=4, cache_salt="s")
    ]
    event = {"parent": None, "token_ids": tokens, "block_hashes": hashes, "block_size": 4}
    diagnosis = diagnose_stored_event(scheme_name="vllm-sha256", seed="0", **event)  # type: ignore[arg-type]
    assert diagnosis.cause == "unverifiable"
    assert "cache_salt" in diagnosis.detail and "unsalted" in diagnosis.detail


def test_diagnosis_says_which_scheme_reproduces_and_why() -> None:
    event = _event(scheme_named("vllm-sha256", seed="42"), list(range(8)))
    diagnosis = diagnose_stored_event(scheme_name="vllm-sha256", seed="0", **event)  # type: ignore[arg-type]
    assert diagnosis.other_seeds == (("vllm-sha256", "42"),)
    assert "PYTHONHASHSEED=42" in diagnosis.detail
    later = {**event, "parent": 5}
    assert diagnose_stored_event(scheme_name="sglang", seed="0", **later).cause == "unverifiable"  # type: ignore[arg-type]


def test_without_a_seed_an_event_that_continues_a_prompt_cannot_tell() -> None:
    """The XXH3 chain always extends its parent, so it fails on a vLLM event that continues a
    prompt; that says nothing about the configured, seedless vLLM scheme."""
    # (xxhash: a scheme that has no seed unless one is configured, unlike sha256)
    first = scheme_named("vllm-xxhash", seed="0").block_hashes(list(range(8)), block_size=4)
    event = _event(scheme_named("vllm-xxhash", seed="0"), list(range(8)))
    later = {**event, "parent": first[0]}
    diagnosis = diagnose_stored_event(scheme_name="vllm-xxhash", seed=None, **later)  # type: ignore[arg-type]
    assert diagnosis.cause == "unverifiable"
